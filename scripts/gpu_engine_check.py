"""The whole engine on CUDA (Triton kernels) against the same engine on the CPU, token for token.

For each tiny preset and both KV-cache modes: one engine on the CPU (float32, the torch backend)
and one on CUDA (float32, `attention_backend="auto"`: Triton without flash-attn), the CUDA model
given the CPU model's weights. The embedding / LM head are scaled up in both so that greedy
choices are decisive (random N(0, 0.02) weights give near-tied logits, where float32 rounding
differences between two correct implementations could flip a token); the CUDA engine's decode
steps replay CUDA graphs where the model allows (all but gpt-oss). Prompts of 5 to 300 tokens,
some sharing a 64-token prefix (prefix caching), 24 generated tokens each, with the tiny presets'
16-token windows releasing blocks as they go. Then a tail replay on the device (tiny-gemma3,
tiny-gpt-oss): a prompt whose windowed blocks were evicted keeps its full-attention hit and
recomputes the windows, with the full-attention KV below the hit point read, never written; its
tokens must equal a cold CPU engine's. Then the next turn of a conversation on each preset: it
hits every token the first turn computed, ending inside a block (token tails). Prints per case the matching outputs and the first
divergence; exits non-zero if fewer than all match.

    python scripts/gpu_engine_check.py            # on a machine with CUDA
    python scripts/gpu_engine_check.py --cpu-dry-run   # the script's logic, CPU vs CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch
from hybrid_cache.attention.selector import attention_backends_by_group

PRESETS = ("tiny-gemma2", "tiny-gemma3", "tiny-llama", "tiny-gpt-oss", "tiny-mistral")
LOGIT_SCALE = 25.0


def prompts(vocab_size: int, count: int = 24) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, vocab_size, (64,), generator=generator).tolist()
    out = []
    for index in range(count):
        length = int(torch.randint(5, 300, (1,), generator=generator))
        body = torch.randint(3, vocab_size, (length,), generator=generator).tolist()
        out.append({"prompt_token_ids": prefix + body if index % 3 == 0 else body})
    return out


def build(llm_class, preset: str, mode: str, device: str, backend: str, **options):
    engine_options = {"kv_cache_memory": "48MiB", "max_model_len": 512, **options}
    return llm_class(
        preset,
        load_format="dummy",
        kv_cache_mode=mode,
        dtype="float32",
        device=device,
        attention_backend=backend,
        seed=0,
        **engine_options,
    )


def sharpen(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
                parameter.mul_(LOGIT_SCALE)


def run_case(llm_class, sampling_params, preset: str, mode: str, device: str, backend: str):
    reference = build(llm_class, preset, mode, "cpu", "torch")
    candidate = build(llm_class, preset, mode, device, backend)
    candidate.model.load_state_dict(reference.model.state_dict())
    sharpen(reference.model)
    sharpen(candidate.model)
    batch = prompts(reference.spec.vocab_size)
    params = sampling_params(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = reference.generate(batch, params, use_tqdm=False)
    started = time.perf_counter()
    got = candidate.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    matches, first_divergence = 0, []
    for want, have in zip(expected, got):
        for output in (want, have):
            output.raise_for_error()
            assert len(output.outputs[0].token_ids) == 24, "every request generates 24 tokens"
        a, b = want.outputs[0].token_ids, have.outputs[0].token_ids
        if a == b:
            matches += 1
        else:
            first_divergence.append(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y))
    backends = sorted(set(attention_backends_by_group(candidate.model).values()))
    graphs = candidate.engine.model_runner.decode_graphs
    replays = (
        f"{graphs.num_replays} decode steps from graphs {sorted(graphs.graphs)}"
        if graphs is not None
        else "eager"
    )
    print(
        f"{preset:13} {mode:8} backends {backends}: {matches}/{len(batch)} identical "
        f"({seconds:.2f} s on {device}; {replays})"
        + (f", first divergence at tokens {first_divergence}" if first_divergence else "")
    )
    return matches == len(batch)


REPLAY_PRESETS = ("tiny-gemma3", "tiny-gpt-oss")
REPLAY_SHARED = 320  # tokens the branch shares with the first prompt (the full-attention hit)


def lose_windows(llm, branch: list[int], start: int) -> None:
    """Holds filler blocks (16-token requests straight on the core) until the branch hits by a
    replay from `start` (a prompt ending at `start` no longer hits it plainly), then frees
    them."""
    coordinator = llm.engine.kv_cache.coordinator
    fillers = []
    while not (
        coordinator.probe_cache_hit(branch) == start
        and coordinator.probe_cache_hit(branch[: start + 1]) < start
    ):
        if coordinator.num_free_blocks < 4 or len(fillers) >= 60:
            raise RuntimeError("the pool ran out before the windows were lost")
        core_id = 10**9 + len(fillers)
        coordinator.add_request(core_id, [7 + (len(fillers) * 16 + i) % 97 for i in range(16)])
        assert coordinator.allocate(core_id, 0, 16)
        fillers.append(core_id)
    for core_id in fillers:
        coordinator.free_request(core_id)


def cold_and_cached(llm_class, preset: str, device: str, backend: str, **options):
    """A cold CPU engine (no prefix caching) and an engine on the device with the same
    sharpened weights, both hybrid."""
    reference = build(
        llm_class, preset, "hybrid", "cpu", "torch", enable_prefix_caching=False, **options
    )
    candidate = build(llm_class, preset, "hybrid", device, backend, **options)
    candidate.model.load_state_dict(reference.model.state_dict())
    sharpen(reference.model)
    sharpen(candidate.model)
    return reference, candidate


def replay_case(llm_class, sampling_params, preset: str, device: str, backend: str) -> bool:
    options = dict(kv_cache_memory="1MiB", max_num_batched_tokens=64, max_num_seqs=64)
    if preset == "tiny-gemma3":  # its per-type pages (`auto` plans equal groups this small)
        options["kv_group_layout"] = "per-type"
    reference, candidate = cold_and_cached(llm_class, preset, device, backend, **options)
    generator = torch.Generator().manual_seed(2)
    vocab = reference.spec.vocab_size
    first = torch.randint(3, vocab, (400,), generator=generator).tolist()
    branch = first[:REPLAY_SHARED] + torch.randint(3, vocab, (40,), generator=generator).tolist()
    params = sampling_params(max_tokens=24, temperature=0.0, ignore_eos=True)
    candidate.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    kv_cache = candidate.engine.kv_cache
    unit = min(group.block_size for group in candidate.layout.groups)
    start = (REPLAY_SHARED - kv_cache.tail_replay_tokens) // unit * unit
    lose_windows(candidate, branch, start)
    (have,) = candidate.generate({"prompt_token_ids": branch}, params, use_tqdm=False)
    (want,) = reference.generate({"prompt_token_ids": branch}, params, use_tqdm=False)
    a, b = want.outputs[0].token_ids, have.outputs[0].token_ids
    replays = candidate.stats.num_tail_replays
    same = a == b and replays == 1 and have.num_cached_tokens == start
    divergence = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(
        f"{preset:13} replay   {replays} replay from {have.num_cached_tokens} (F "
        f"{REPLAY_SHARED}): " + ("identical" if a == b else f"first divergence at {divergence}")
    )
    return same


def tail_case(llm_class, sampling_params, preset: str, device: str, backend: str) -> bool:
    """The next turn of a conversation on the device: it hits every token the first turn
    computed, ending inside a block (token tails), and writes the rest of that block."""
    options = dict(kv_cache_memory="4MiB", max_num_batched_tokens=64)
    reference, candidate = cold_and_cached(llm_class, preset, device, backend, **options)
    generator = torch.Generator().manual_seed(3)
    vocab = reference.spec.vocab_size
    # 203 + 24 - 1 = 226 tokens computed: 2 of them in a block.
    first = torch.randint(3, vocab, (203,), generator=generator).tolist()
    new = torch.randint(3, vocab, (30,), generator=generator).tolist()
    params = sampling_params(max_tokens=24, temperature=0.0, ignore_eos=True)
    (one,) = candidate.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    turn = first + list(one.outputs[0].token_ids) + new
    (have,) = candidate.generate({"prompt_token_ids": turn}, params, use_tqdm=False)
    (want,) = reference.generate({"prompt_token_ids": turn}, params, use_tqdm=False)
    a, b = want.outputs[0].token_ids, have.outputs[0].token_ids
    computed = len(first) + len(one.outputs[0].token_ids) - 1
    assert computed % 16 != 0, "the first turn must end inside a block"
    same = a == b and have.num_cached_tokens == computed
    divergence = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(
        f"{preset:13} tails    hit {have.num_cached_tokens} of {computed} computed: "
        + ("identical" if a == b else f"first divergence at {divergence}")
    )
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="CPU 'reference' vs CPU torch")
    args = parser.parse_args()
    from hybrid_cache.engine.llm import LLM
    from hybrid_cache.engine.sampling_params import SamplingParams

    if args.cpu_dry_run:
        device, backend = "cpu", "reference"
    elif torch.cuda.is_available():
        device, backend = "cuda", "auto"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        print("no CUDA device (use --cpu-dry-run to check the script on the CPU)")
        return 2
    common = (LLM, SamplingParams)
    cases = [
        (preset, mode, partial(run_case, *common, preset, mode, device, backend))
        for preset in PRESETS
        for mode in ("hybrid", "uniform")
    ]
    cases += [
        (preset, "replay", partial(replay_case, *common, preset, device, backend))
        for preset in REPLAY_PRESETS
    ]
    cases += [
        (preset, "tails", partial(tail_case, *common, preset, device, backend))
        for preset in PRESETS
    ]
    ok = True
    for preset, label, case in cases:
        try:
            ok &= case()
        except Exception as error:  # noqa: BLE001 - report every case, fail at the end
            ok = False
            print(f"{preset:13} {label:8} FAILED: {type(error).__name__}: {error}")
    print("ALL IDENTICAL" if ok else "MISMATCH OR FAILURE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
