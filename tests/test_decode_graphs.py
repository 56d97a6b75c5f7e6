"""Decode steps replayed from per-bucket graphs (`engine/decode_graphs.py`), on the CPU.

CUDA graphs need a GPU; here a stand-in `Graph` records the forward as a function and replays it
by calling it again, so everything around the recording is exercised: the static buffers, the
padding rows, the buckets, the runner's choice of steps. The Triton kernels run interpreted, as
on CUDA. What the stand-in cannot show (launches recorded by CUDA, a pool shared by the graphs)
is checked on a GPU by scripts/gpu_engine_check.py, whose CUDA engine replays graphs by default.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_cache import LLM
from hybrid_cache.engine.decode_graphs import (
    DecodeGraphs,
    decode_buckets,
    supports_decode_graphs,
)
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.models import gpt_oss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_BATCH = 6


class RecordedCall:
    """`Graph` for the CPU: the recording is the function itself."""

    def capture(self, fn):
        self.fn = fn
        self.output = fn()
        return self.output

    def replay(self):
        self.output.copy_(self.fn())


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_buckets_are_powers_of_two_then_the_largest_batch():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(33) == [1, 2, 4, 8, 16, 32, 33]


def test_graphs_need_cuda_and_triton_layers():
    llm = build(enforce_eager=False)
    assert not supports_decode_graphs(llm.model, torch.device("cpu"))
    assert llm.engine.model_runner.decode_graphs is None  # the CPU runs eagerly
    # Asked of a CUDA device (no GPU needed to ask): Triton layers yes, torch layers no.
    assert supports_decode_graphs(llm.model, torch.device("cuda"))
    assert not supports_decode_graphs(
        build(enforce_eager=True, attention_backend="torch").model, torch.device("cuda")
    )


def build(enforce_eager: bool, preset: str = "tiny-gemma3", **options) -> LLM:
    options.setdefault("attention_backend", "triton")
    return LLM(
        preset,
        device="cpu",
        kv_cache_memory="2MiB",
        max_model_len=256,
        max_num_seqs=MAX_BATCH,
        enforce_eager=enforce_eager,
        **options,
    )


def with_recorded_graphs(llm: LLM) -> DecodeGraphs:
    runner = llm.engine.model_runner
    graphs = DecodeGraphs(
        llm.model,
        runner.kv_caches,
        runner.block_sizes,
        llm.max_model_len,
        MAX_BATCH,
        torch.device("cpu"),
        make_graph=RecordedCall,
    )
    runner.decode_graphs = graphs
    return graphs


def prompts_and_params():
    generator = torch.Generator().manual_seed(4)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 200, (length,), generator=generator).tolist()}
        for length in (5, 40, 17, 70, 3)
    ]
    # Different lengths: the batch shrinks as requests finish, through several buckets.
    params = [
        SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for tokens in (24, 6, 13, 20, 2)
    ]
    return prompts, params


def test_replayed_decode_steps_give_the_eager_tokens_and_write_only_their_slots():
    eager = build(enforce_eager=True)
    prompts, params = prompts_and_params()
    expected = tokens(eager, prompts, params)

    llm = build(enforce_eager=True)  # the same weights (preset, seed)
    graphs = with_recorded_graphs(llm)
    runner = llm.engine.model_runner
    run = graphs.run
    steps = []

    def checked_run(input_ids, positions, metadata):
        before = [slot.clone() for slot in runner.slot_tensors]
        out = run(input_ids, positions, metadata)
        written = {
            (group.block_size, int(slot))
            for group in metadata.groups
            for slot in group.slot_mapping.tolist()
        }
        for old, new in zip(before, runner.slot_tensors):
            changed = (old != new).any(dim=1).nonzero().flatten().tolist()
            pages = {slot // size for size, slot in written}
            assert set(changed) <= pages, (changed, pages)
        steps.append(len(positions))
        return out

    graphs.run = checked_run
    assert tokens(llm, prompts, params) == expected
    assert graphs.num_replays == len(steps) > 0
    assert set(graphs.graphs) == {graphs.bucket_of(n) for n in steps}
    assert len(graphs.graphs) >= 3, "the batch shrank through several buckets"
    assert any(n not in graphs.buckets for n in steps), "no step ran with padding rows"
    kv_cache = llm.engine.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_blocks - 1


def test_prefill_and_oversized_batches_run_eagerly():
    llm = build(enforce_eager=True, max_num_batched_tokens=32)
    graphs = with_recorded_graphs(llm)
    graphs.buckets = [1, 2]  # batches of 3+ are too large
    prompts, params = prompts_and_params()
    eager = build(enforce_eager=True, max_num_batched_tokens=32)
    expected = tokens(eager, prompts, params)
    assert tokens(llm, prompts, params) == expected
    assert set(graphs.graphs) <= {1, 2}  # only the last requests' decode steps replayed
    assert 0 < graphs.num_replays < sum(p.max_tokens for p in params)


def test_a_failed_recording_falls_back_to_eager_steps(caplog):
    class Refused(RecordedCall):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    prompts, params = prompts_and_params()
    expected = tokens(build(enforce_eager=True), prompts[:2], params[:2])
    llm = build(enforce_eager=True)
    graphs = with_recorded_graphs(llm)
    graphs.make_graph = Refused
    with caplog.at_level("WARNING", logger="hybrid_cache.engine.model_runner"):
        assert tokens(llm, prompts[:2], params[:2]) == expected
    assert llm.engine.model_runner.decode_graphs is None and not graphs.graphs
    assert "recording the decode forward of a batch of 2 failed" in caplog.text


def test_recorded_gpt_oss_steps_run_every_expert_densely(monkeypatch):
    """While recording, gpt-oss's experts run densely (nothing read on the host): the same
    tokens as the eager per-expert loop, here with the recording stand-in and the dense path
    forced on (the CPU never records)."""
    prompts, params = prompts_and_params()
    expected = tokens(build(enforce_eager=True, preset="tiny-gpt-oss"), prompts, params)
    llm = build(enforce_eager=True, preset="tiny-gpt-oss")
    graphs = with_recorded_graphs(llm)
    dense = []
    forward_dense = gpt_oss.GptOssExperts.forward_dense

    def counted(self, *args):
        dense.append(args[0].shape[0])
        return forward_dense(self, *args)

    monkeypatch.setattr(gpt_oss, "recording", lambda hidden: True)
    monkeypatch.setattr(gpt_oss.GptOssExperts, "forward_dense", counted)
    assert tokens(llm, prompts, params) == expected
    assert graphs.num_replays > 0 and dense


def test_dense_experts_equal_the_per_expert_loop():
    llm = build(enforce_eager=True, preset="tiny-gpt-oss")
    mlp = next(module for module in llm.model.modules() if isinstance(module, gpt_oss.GptOssMLP))
    hidden = torch.randn(9, llm.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    top_experts, top_weights = mlp.router(hidden)
    assert len(set(top_experts.flatten().tolist())) > 1
    sparse = mlp.experts(hidden, top_experts, top_weights)
    dense = mlp.experts.forward_dense(hidden, top_experts, top_weights)
    torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-5)


def test_gpt_oss_caps_its_recorded_batches(monkeypatch):
    from hybrid_cache.engine import model_runner

    built = []
    monkeypatch.setattr(model_runner, "supports_decode_graphs", lambda model, device: True)
    monkeypatch.setattr(model_runner, "DecodeGraphs", lambda *args: built.append(args[4]))
    LLM("tiny-gpt-oss", device="cpu", kv_cache_memory="2MiB", max_model_len=64, max_num_seqs=256)
    LLM("tiny-gemma3", device="cpu", kv_cache_memory="2MiB", max_model_len=64, max_num_seqs=256)
    assert built == [gpt_oss.GptOssForCausalLM.max_cuda_graph_batch, 256]
