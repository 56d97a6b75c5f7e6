"""Tensor parallelism on the CPU (gloo): the same greedy tokens on N ranks as on one and as
transformers', for every architecture, through preemption, prefix hits, window release and an
abort; a rank that dies or hangs ends the engine with `WorkerFailedError` naming it.

Each architecture's checkpoint is a tiny seeded transformers model saved as safetensors
(`test_models_vs_hf.make_hf_model`), so every rank reads its slices of the files. The KV budget
of each engine is sized to the same number of blocks on one rank and on N (a rank's page holds
its share of the KV heads), so both runs schedule alike and preempt alike.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from hybrid_cache.cli import main
from hybrid_cache.config import load_model_spec
from hybrid_cache.engine import LLM, SamplingParams
from hybrid_cache.engine import llm as llm_module
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.parallel.worker import TEST_FAULT_ENV
from hybrid_cache.errors import WorkerFailedError
from hybrid_cache.planner import plan_kv_cache, report_plan
from test_models_vs_hf import make_hf_model

PREFIX_LEN = 12
TAILS = (9, 17, 1, 25, 13)  # the first wave's prompts: the shared prefix + a tail each
MAX_TOKENS = 10
SPARE_BLOCKS = 2  # usable blocks beyond one max_model_len request's: tight enough to preempt
ENGINE = dict(
    max_model_len=64,
    block_size=4,
    max_num_batched_tokens=16,
    max_num_seqs=8,
    enable_prefix_caching=True,
    dtype="float32",
    device="cpu",
    # Plain LRU: in a pool this small protected chains change which cached blocks survive,
    # and with them whether Mistral's run preempts at all (the preemption path is tested here).
    protected_prefix_fraction=0.0,
)
ABORT_AT_STEP = 4
ABORTED = "w1-2"


def budget_for(model: str, tensor_parallel_size: int) -> tuple[int, int]:
    """The KV budget (bytes per device) that gives each rank the blocks of one max_model_len
    request and `SPARE_BLOCKS` more (the same count on any number of ranks), and that count,
    in the layout the engine plans for that budget (a pool this small may keep equal groups
    where a large one gets the per-type layout: docs/PLANNER.md)."""
    config = EngineConfig(model, tensor_parallel_size=tensor_parallel_size, **ENGINE)
    spec = config.model_spec().per_rank(tensor_parallel_size)
    budget = 1 << 30
    for _ in range(3):
        options = config.plan_options(budget, ENGINE["max_model_len"], kv_cache_dtype="float32")
        layout = plan_kv_cache(spec, options)
        num_blocks = report_plan(layout, spec).blocks_per_request + SPARE_BLOCKS
        previous, budget = budget, (num_blocks + 1) * layout.page_bytes * layout.layers_per_group
        if budget == previous:
            return budget, num_blocks
    raise AssertionError(f"no budget of one request's blocks is stable for {model}")


def workload_prompts(vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, vocab_size, (PREFIX_LEN,), generator=generator).tolist()
    first = [
        prefix + torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in TAILS
    ]
    # The second wave hits the first's blocks: one prompt again whole, one sharing the prefix.
    second = [first[0], prefix + torch.randint(0, vocab_size, (15,), generator=generator).tolist()]
    return first, second


class WorkloadRun:
    """One engine's run of the workload through the step API: what each request generated,
    and whether preemption, prefix hits and window release happened."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.tokens: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.released_window_blocks = 0
        first, second = workload_prompts(llm.spec.vocab_size)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        engine = llm.engine
        for wave, prompts in (("w1", first), ("w2", second)):
            for index, prompt in enumerate(prompts):
                request_id = f"{wave}-{index}"
                self.prompts[request_id] = prompt
                engine.add_request(request_id, prompt, params)
            step = 0
            while engine.has_unfinished_requests():
                for request in engine.step():
                    assert request.error is None, request.error
                    self.tokens[request.request_id] = list(request.output_token_ids)
                step += 1
                self._count_released()
                if wave == "w1" and step == ABORT_AT_STEP:
                    aborted = engine.abort_request(ABORTED)
                    assert aborted is not None
                    self.tokens[ABORTED] = list(aborted.output_token_ids)
        self.stats = llm.stats

    def _count_released(self) -> None:
        """Windowed groups' table rows that start with the null block (released blocks)."""
        kv_cache = self.llm.engine.kv_cache
        for group, layout_group in enumerate(self.llm.layout.groups):
            if layout_group.kind != "sliding_window":
                continue
            for row in kv_cache.rows.values():
                if (
                    kv_cache.block_table[group, row, 0] == 0
                    and kv_cache.block_table[group, row, 1:].any()
                ):
                    self.released_window_blocks += 1


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int]) -> list[int]:
    generated = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # token 0 is no padding
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return generated[0, len(prompt) :].tolist()


def run_engine(folder: str, tensor_parallel_size: int, **engine: Any) -> WorkloadRun:
    budget, num_blocks = budget_for(folder, tensor_parallel_size)
    with LLM(
        folder,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_memory=budget,
        **ENGINE,
        **engine,
    ) as llm:
        assert llm.layout.num_blocks == num_blocks + 1
        workers = [] if llm.parallel is None else list(llm.parallel.processes)
        assert len(workers) == tensor_parallel_size - 1
        run = WorkloadRun(llm)
    # Leaving the `with` shut the engine down: every worker exited, the groups are gone.
    assert all(worker.exitcode == 0 for worker in workers)
    assert not torch.distributed.is_initialized()
    return run


CASES = [
    *((name, 2) for name in ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")),
    ("gpt_oss", 2),
    ("gpt_oss", 4),  # 2 KV heads over 4 ranks: each head on two ranks
]


def assert_same_tokens_as_one_rank_and_transformers(
    hf_model: torch.nn.Module, folder: str, tensor_parallel_size: int, **engine: Any
) -> None:
    one_rank = run_engine(folder, 1)
    sharded = run_engine(folder, tensor_parallel_size, **engine)
    assert sharded.tokens == one_rank.tokens
    # The run exercised what it claims to.
    assert one_rank.stats.num_preemptions > 0, "nothing was preempted: lower SPARE_BLOCKS"
    assert sharded.stats.num_preemptions == one_rank.stats.num_preemptions
    assert one_rank.stats.num_prefix_hit_tokens > 0
    assert sharded.stats.num_prefix_hit_tokens == one_rank.stats.num_prefix_hit_tokens
    if any(layer.kind == "sliding_window" for layer in load_model_spec(folder).layers):
        assert sharded.released_window_blocks > 0
    assert 0 < len(sharded.tokens[ABORTED]) < MAX_TOKENS
    for request_id, tokens in sharded.tokens.items():
        if request_id != ABORTED:
            assert tokens == hf_greedy(hf_model, sharded.prompts[request_id]), request_id
    assert sum(len(set(tokens)) > 1 for tokens in sharded.tokens.values()) >= 3


@pytest.mark.parametrize(("name", "tensor_parallel_size"), CASES)
def test_tokens_match_one_rank_and_transformers(
    name: str, tensor_parallel_size: int, tmp_path
) -> None:
    """The default sharding: the embedding and the LM head vocabulary-parallel too."""
    hf_model, folder = make_hf_model(name, tmp_path)
    assert_same_tokens_as_one_rank_and_transformers(hf_model, folder, tensor_parallel_size)


@pytest.mark.parametrize(
    ("name", "vocab_size", "tensor_parallel_size"),
    [("llama3", 255, 2), ("gemma2", 255, 2), ("gpt_oss", 254, 4)],
)
def test_a_vocabulary_the_ranks_do_not_divide_is_padded_and_never_sampled(
    name: str, vocab_size: int, tensor_parallel_size: int, tmp_path
) -> None:
    """255 ids over 2 ranks (one padded row on rank 1; gemma2's head is the tied embedding,
    its logits soft-capped after the gather), 254 over 4 (two on rank 3): the same tokens."""
    hf_model, folder = make_hf_model(name, tmp_path, vocab_size=vocab_size)
    assert_same_tokens_as_one_rank_and_transformers(hf_model, folder, tensor_parallel_size)


def test_a_replicated_vocabulary_gives_the_same_tokens(tmp_path) -> None:
    """`vocab_parallel=False` (`--no-vocab-parallel`): every rank holds the whole embedding and
    LM head, and only rank 0 computes logits."""
    hf_model, folder = make_hf_model("gemma2", tmp_path, vocab_size=255)
    assert_same_tokens_as_one_rank_and_transformers(hf_model, folder, 2, vocab_parallel=False)


def logprob_values(entries) -> list[dict[int, float]]:
    return [{} if entry is None else {k: v.logprob for k, v in entry.items()} for entry in entries]


def test_logprobs_on_a_vocabulary_parallel_head_match_one_rank(tmp_path) -> None:
    """Prompt logprobs of a 600-token prompt (two chunks of the LM head in one step, which
    every rank runs alike), sampled-token logprobs, and a request without either in the same
    batch: equal to one rank's."""
    _, folder = make_hf_model("llama3", tmp_path, max_position_embeddings=1024)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [prompt, [3, 1, 4, 1, 5]]
    params = [
        SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.0),
    ]
    results = {}
    for size in (1, 2):
        with LLM(
            folder,
            tensor_parallel_size=size,
            kv_cache_memory="4MiB",
            max_model_len=640,
            max_num_batched_tokens=640,
            distributed_timeout=30.0,  # a rank calling the head out of step fails, not hangs
        ) as llm:
            results[size] = llm.generate(prompts, params, use_tqdm=False)
    for one, two in zip(results[1], results[2]):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
    one, two = results[1][0], results[2][0]
    assert len(two.prompt_logprobs) == len(prompt)
    for ours, theirs in zip(
        logprob_values(two.prompt_logprobs), logprob_values(one.prompt_logprobs)
    ):
        assert ours == pytest.approx(theirs, abs=1e-4)
    sampled = logprob_values(two.outputs[0].logprobs)
    for ours, theirs in zip(sampled, logprob_values(one.outputs[0].logprobs), strict=True):
        assert len(ours) >= 3 and ours == pytest.approx(theirs, abs=1e-4)


@pytest.fixture
def small_engine():
    llm = LLM(
        "tiny-llama",
        tensor_parallel_size=2,
        kv_cache_memory="2MiB",
        max_model_len=128,
        distributed_timeout=3.0,
    )
    yield llm
    llm.shutdown()


def start_requests(llm: LLM) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for index in range(4):
        llm.engine.add_request(str(index), [1 + index, 2, 3, 4, 5], params)
    for _ in range(3):
        llm.engine.step()


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_failed_worker_ends_the_engine_naming_its_rank(small_engine: LLM, how: str) -> None:
    llm = small_engine
    start_requests(llm)
    worker = llm.parallel.processes[0]
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as error:
        for _ in range(100):
            llm.engine.step()
    elapsed = time.monotonic() - started
    assert error.value.rank == 1
    expected = "was killed by signal 9" if how == "killed" else "did not answer within"
    assert expected in str(error.value)
    # Within the collective timeout (3 s), plus the moment a lost connection takes to show.
    assert elapsed < 3.0 + 2.0
    worker.join(5)
    assert worker.exitcode is not None, "the failed engine stops its workers"
    with pytest.raises(WorkerFailedError):
        llm.engine.step()  # the engine stays failed


def test_a_workers_traceback_reaches_rank_0(monkeypatch) -> None:
    """A worker that raises in a step (the test-only fault hook, inherited by the spawned
    worker through the environment) ends the engine with its traceback in the error."""
    monkeypatch.setenv(TEST_FAULT_ENV, "1:5")
    with LLM(
        "tiny-llama",
        tensor_parallel_size=2,
        kv_cache_memory="2MiB",
        max_model_len=128,
        distributed_timeout=3.0,
    ) as llm:
        start_requests(llm)  # steps 1-3
        worker = llm.parallel.processes[0]
        started = time.monotonic()
        with pytest.raises(WorkerFailedError) as error:
            for _ in range(10):
                llm.engine.step()
        assert time.monotonic() - started < 3.0 + 2.0
    message = str(error.value)
    assert error.value.rank == 1
    assert "tensor-parallel rank 1 exited with code 1" in message
    assert "rank 1 raised:\nTraceback (most recent call last):" in message
    assert "in serve" in message
    assert message.endswith(f"RuntimeError: test fault in rank 1's step 5 ({TEST_FAULT_ENV})")
    assert worker.exitcode == 1


def delay_worker_start(monkeypatch, tmp_path, code: str) -> None:
    """Runs `code` in every process spawned from here on before anything else it imports (a
    `sitecustomize` module first on its path)."""
    (tmp_path / "sitecustomize.py").write_text(code)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ("" if not path else os.pathsep + path))


def test_workers_slower_to_start_than_the_collective_timeout_still_join(
    monkeypatch, tmp_path
) -> None:
    """The rendezvous waits for the workers' imports, not the collective timeout."""
    delay_worker_start(monkeypatch, tmp_path, "import time\ntime.sleep(3.0)\n")
    started = time.monotonic()
    with LLM(
        "tiny-llama",
        tensor_parallel_size=2,
        kv_cache_memory="2MiB",
        max_model_len=64,
        distributed_timeout=1.0,
    ) as llm:
        assert time.monotonic() - started > 3.0  # the delay was there
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        (output,) = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_a_worker_that_exits_while_starting_fails_the_start_naming_it(
    monkeypatch, tmp_path
) -> None:
    delay_worker_start(monkeypatch, tmp_path, "import os\nos._exit(3)\n")
    with pytest.raises(
        WorkerFailedError, match="rank 1 exited with code 3 while starting"
    ) as error:
        LLM(
            "tiny-llama",
            tensor_parallel_size=2,
            kv_cache_memory="2MiB",
            max_model_len=64,
            distributed_timeout=1.0,
        )
    assert error.value.rank == 1


DRIVER_SCRIPT = """
import time
from hybrid_cache.engine import LLM

if __name__ == "__main__":
    llm = LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory="2MiB", max_model_len=64,
              distributed_timeout=5.0)
    print("WORKER", llm.parallel.processes[0].pid, flush=True)
    time.sleep(120)
"""


def process_gone(pid: int) -> bool:
    """Whether `pid` has exited (no such process, or a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_worker_exits_when_its_driver_is_killed(tmp_path) -> None:
    """Rank 0 killed (SIGKILL: no shutdown runs) leaves no orphan: its worker exits by itself
    within the collective timeout (5 s)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=environment
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("WORKER"), line
        worker = int(line.split()[1])
        assert not process_gone(worker)
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 5.0
        while not process_gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_gone(worker), "the worker outlived its driver"
    finally:
        driver.kill()
        driver.wait(10)


def test_bench_runs_each_mode_on_n_ranks_and_on_one(tmp_path, capsys) -> None:
    json_path = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny-gemma2", "--input-len", "24", "--output-len", "4"]
    argv += ["--num-prompts", "8", "--kv-cache-memory", "1MiB", "--kv-cache-mode", "hybrid"]
    argv += ["--tensor-parallel-size", "2", "--output-json", str(json_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "== hybrid (tensor parallel 2, measured;" in printed
    assert "Step broadcast (rank 0 to the other ranks): posting it" in printed
    assert "the slowest worker had it" in printed
    assert "hybrid: tensor parallel 2 / 1: " in printed
    results = json.loads(json_path.read_text())["results"]
    assert set(results) == {"hybrid", "hybrid tp1"}
    sharded, one_rank = results["hybrid"], results["hybrid tp1"]
    assert (sharded["tensor_parallel_size"], one_rank["tensor_parallel_size"]) == (2, 1)
    assert 0 < sharded["broadcast_share"] < 1 and one_rank["broadcast_share"] is None
    assert 0 < sharded["broadcast_latency_share"] < 1
    assert one_rank["broadcast_latency_share"] is None
    assert len(sharded["steps"]["broadcast_time_s"]) == sharded["num_steps"]
    assert len(sharded["steps"]["broadcast_latency_s"]) == sharded["num_steps"]
    assert sharded["steps"]["running"] == one_rank["steps"]["running"]  # the same schedule


TORCHRUN_SCRIPT = """
from hybrid_cache.engine import LLM, SamplingParams
from hybrid_cache.engine import llm as llm_module

llm = LLM("tiny-gemma2", tensor_parallel_size=2, kv_cache_memory="2MiB", max_model_len=64)
out = llm.generate([[1, 2, 3, 4], [9, 8]], SamplingParams(max_tokens=6), use_tqdm=False)
print("TOKENS", [list(o.outputs[0].token_ids) for o in out], flush=True)
llm.shutdown()
"""


def test_torchrun_starts_every_rank_from_one_script(tmp_path) -> None:
    """Under torchrun every rank runs the script: rank 1's `LLM(...)` serves rank 0's steps and
    exits its process when rank 0 shuts down; only rank 0 gets past it."""
    script = tmp_path / "serve.py"
    script.write_text(TORCHRUN_SCRIPT)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(printed) == 1, result.stdout  # rank 0 only
    with LLM("tiny-gemma2", kv_cache_memory="2MiB", max_model_len=64) as one_rank:
        out = one_rank.generate(
            [[1, 2, 3, 4], [9, 8]], SamplingParams(max_tokens=6), use_tqdm=False
        )
    assert printed[0] == f"TOKENS {[list(o.outputs[0].token_ids) for o in out]}"


def test_a_driver_failing_in_setup_stops_its_workers(monkeypatch) -> None:
    """Rank 0 fails after the workers loaded (here: building its engine): the `LLM` raises that
    error at once, its workers are gone and the process group with them."""

    def fail(*args, **kwargs):
        raise RuntimeError("rank 0 could not build its engine")

    monkeypatch.setattr(llm_module.LLMEngine, "from_model", fail)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 could not build its engine"):
        LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory="2MiB", max_model_len=64)
    assert time.monotonic() - started < 30
    assert multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()
