"""Attention backends: the Triton backend against the torch reference, and the selection rules.

The Triton backend runs on the CPU under TRITON_INTERPRET=1 (set below, before anything imports
Triton). Every comparison draws fresh random inputs (the seed is in each failure message; set
HYBRID_CACHE_TEST_SEED to replay one); caches are NaN wherever no sequence may read, and block 0
(the null block) is NaN, so a backend that reads a released page fails.

The FlashAttention backend cannot run here (no GPU, flash-attn not installed): only its
capability checks and refusal errors are tested, never its attention call.
"""

import os

# Must be set before Triton decorates the kernels (before hybrid_cache.kernels' launchers load).
os.environ["TRITON_INTERPRET"] = "1"

import random
import subprocess
import sys
import textwrap

import pytest
import torch
from hybrid_cache.attention import (
    assign_layer_groups,
    attention_layers,
    build_attention_metadata,
    flash_attn_backend,
    reference,
    selector,
    torch_batched,
    triton_backend,
)
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.attention.selector import (
    AttentionBackendUnavailableError,
    AttentionFeatures,
    UnknownAttentionBackendError,
    attention_backends_by_group,
    describe_attention_backends,
    get_attention_backend,
    register_attention_backend,
    resolve_attention_backend,
    select_attention_backends,
)
from hybrid_cache.errors import HybridCacheError
from hybrid_cache.models import load_model
from hybrid_cache.presets import read_preset

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only a name here: no test below touches a GPU

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def fresh_seed() -> int:
    override = os.environ.get("HYBRID_CACHE_TEST_SEED")
    return int(override) if override else random.SystemRandom().randrange(2**31)


def paged_step(
    seed: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int | None,
    chunk: int | None,
):
    """One random step: mixed prefill chunks and decode rows, tables with null blocks left of the
    visible range, and an engine-style K/V layout (k and v strided views of one tensor)."""
    generator = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)
    # decode with a long context, a first prefill chunk, decode with a short context, a later chunk
    query_lens = [1, draw.randint(2, 7), 1, draw.randint(2, 6)]
    # The first context is >= 10 tokens so windows below 8 (block size 4) always release a block.
    computed = [draw.randint(10, 20), 0, draw.randint(0, 3), draw.randint(4, 15)]
    seq_lens = [q + c for q, c in zip(query_lens, computed)]
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = 1 + sum(blocks_per_seq) + 2  # the null block, every page, two spares
    pages = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    layout = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
    layout = layout.to(dtype)
    k_cache, v_cache = layout[:, 0], layout[:, 1]
    num_null_entries = 0
    for seq, first_query in enumerate(computed):
        low = reference.first_visible_position(first_query, sliding_window, chunk)
        for index in range(blocks_per_seq[seq]):
            if (index + 1) * block_size <= low:
                num_null_entries += 1  # released: stays the null block
                continue
            page = pages.pop()
            table[seq, index] = page
            # The cached (visible) part of the context gets numbers; new tokens are written
            # by the backend; the rest stays NaN.
            first = max(low - index * block_size, 0)
            last = min(first_query - index * block_size, block_size)
            if last > first:
                for cache in (k_cache, v_cache):
                    values = torch.randn(last - first, num_kv_heads, head_dim, generator=generator)
                    cache[page, first:last] = values.to(dtype)
    metadata, _ = build_attention_metadata(query_lens, computed, [table], [block_size])
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    return metadata, layout, q, k, v, num_null_entries


def run_backend(backend, metadata, layout, q, k, v, params):
    layout = layout.clone()
    k_cache, v_cache = layout[:, 0], layout[:, 1]
    group = metadata.groups[0]
    backend.write_kv(k_cache, v_cache, k, v, group.slot_mapping)
    out = backend.paged_attention(q, k_cache, v_cache, metadata, group, params)
    return out, layout


# (heads, kv heads, head dim, block size, dtype, window, chunk, softcap, sinks)
CASES = [
    pytest.param(4, 2, 16, 4, torch.float32, None, None, None, False, id="full-gqa2"),
    pytest.param(2, 2, 16, 4, torch.float32, 5, None, None, False, id="window5-mha"),
    pytest.param(8, 2, 16, 4, torch.float32, 7, None, 30.0, True, id="window7-gqa4-softcap-sinks"),
    pytest.param(8, 1, 16, 8, torch.float32, 100, None, None, False, id="window>context-gqa8"),
    pytest.param(4, 2, 16, 4, torch.float32, None, 6, None, False, id="chunk6"),
    pytest.param(4, 2, 32, 4, torch.bfloat16, 6, None, None, True, id="bf16-window6-sinks"),
]


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype, window, chunk, softcap, sinks", CASES
)
def test_triton_backend_matches_reference_backend(
    num_heads, num_kv_heads, head_dim, block_size, dtype, window, chunk, softcap, sinks
):
    seed = fresh_seed()
    metadata, layout, q, k, v, num_null = paged_step(
        seed,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        sliding_window=window,
        chunk=chunk,
    )
    params = AttentionParams(
        scale=head_dim**-0.5,
        sliding_window=window,
        softcap=softcap,
        chunk=chunk,
        sinks=(torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
        if sinks
        else None,
    )
    message = f"seed={seed} seq_lens={metadata.seq_lens.tolist()} null entries={num_null}"
    expected, expected_layout = run_backend(reference, metadata, layout, q, k, v, params)
    got, got_layout = run_backend(triton_backend, metadata, layout, q, k, v, params)
    # The same bytes written at the same slots (NaN elsewhere on both sides).
    torch.testing.assert_close(got_layout, expected_layout, equal_nan=True, rtol=0, atol=0)
    assert torch.isfinite(got).all(), f"NaN/inf in the Triton output ({message})"
    torch.testing.assert_close(
        got.float(), expected.float(), **TOLERANCES[dtype], msg=lambda text: f"{text}\n{message}"
    )
    if window is not None and window < 8 or chunk is not None:
        assert num_null > 0, f"the step should hold null blocks ({message})"


def test_metadata_is_converted_once_per_step_not_per_layer(monkeypatch):
    seed = fresh_seed()
    metadata, layout, q, k, v, _ = paged_step(
        seed,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        sliding_window=None,
        chunk=None,
    )
    # A table in another dtype (int64) must still reach the kernel as int32, converted once.
    metadata.groups[0].block_table = metadata.groups[0].block_table.long()
    conversions = []
    original = triton_backend.as_kernel_int32

    def counting(tensor, device):
        conversions.append(tensor)
        return original(tensor, device)

    monkeypatch.setattr(triton_backend, "as_kernel_int32", counting)
    outputs = [
        run_backend(triton_backend, metadata, layout, q, k, v, AttentionParams(0.25))[0]
        for _ in range(3)
    ]
    # Three "layers": query_start_loc, seq_lens and the table are converted once each.
    assert len(conversions) == 3, f"{len(conversions)} conversions for 3 layers of one step"
    assert triton_backend.step_tensors(metadata, CPU) is triton_backend.step_tensors(metadata, CPU)
    table = triton_backend.group_block_table(metadata.groups[0], CPU)
    assert table.dtype == torch.int32 and table.is_contiguous()
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    # A runner that replaces a field (e.g. moves it to the device) gets a fresh conversion.
    metadata.seq_lens = metadata.seq_lens.clone()
    triton_backend.step_tensors(metadata, CPU)
    assert len(conversions) == 5


# ---------------------------------------------------------------- selection rules


def features(**changes) -> AttentionFeatures:
    values = dict(block_size=16, head_dim=64, dtype=torch.float32)
    values.update(changes)
    return AttentionFeatures(**values)


@pytest.fixture
def fake_cuda_machine(monkeypatch):
    """Decision logic of a CUDA machine with Triton compiled and flash_attn importable (nothing
    touches a GPU: the rules only read these probes)."""
    monkeypatch.setattr(selector, "_flash_attn_import_error", lambda: None)
    monkeypatch.setattr(selector, "_triton_import_error", lambda: None)
    monkeypatch.setattr(selector, "triton_kernels_interpreted", lambda: False)
    monkeypatch.setattr(selector, "triton_interpreter_requested", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # skips the sm80 query


def test_auto_on_the_cpu_is_the_torch_reference():
    # Even with TRITON_INTERPRET=1 set (as in this process): the interpreter is for tests only.
    assert resolve_attention_backend("auto", CPU, features()) == "torch"
    assert resolve_attention_backend("auto", "cpu", features(sinks=True, chunk=8)) == "torch"
    assert resolve_attention_backend("torch", CPU, features()) == "torch"


def test_forced_triton_on_the_cpu_runs_under_the_interpreter():
    assert resolve_attention_backend("triton", CPU, features(sinks=True, chunk=4)) == "triton"


def test_forced_triton_on_the_cpu_without_the_interpreter_is_refused():
    """In a clean process: TRITON_INTERPRET unset, then set only after the kernels loaded."""
    script = textwrap.dedent(
        """
        import os
        import torch
        from hybrid_cache.attention.selector import (
            AttentionBackendUnavailableError, AttentionFeatures, resolve_attention_backend)
        from hybrid_cache.errors import HybridCacheError
        features = AttentionFeatures(block_size=16, head_dim=64, dtype=torch.float32)
        assert resolve_attention_backend("auto", "cpu", features) == "torch"
        try:
            resolve_attention_backend("triton", "cpu", features)
        except AttentionBackendUnavailableError as error:
            assert isinstance(error, HybridCacheError)
            print("UNSET:", error)
        else:
            raise SystemExit("triton was accepted on the CPU without TRITON_INTERPRET")
        import hybrid_cache.kernels.paged_attention  # decorated for the GPU: mode now fixed
        os.environ["TRITON_INTERPRET"] = "1"  # too late
        try:
            resolve_attention_backend("triton", "cpu", features)
        except AttentionBackendUnavailableError as error:
            print("LATE:", error)
        else:
            raise SystemExit("triton was accepted after the kernels loaded without the interpreter")
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    unset, late = result.stdout.strip().splitlines()[-2:]
    assert unset.startswith("UNSET:") and "TRITON_INTERPRET=1" in unset
    assert "'torch'" in unset  # says what to choose instead
    assert late.startswith("LATE:") and "already imported" in late


def test_forced_triton_on_cuda_with_the_interpreter_set_is_refused():
    # This process has TRITON_INTERPRET=1: the kernels would run on the CPU only.
    with pytest.raises(AttentionBackendUnavailableError, match="unset it"):
        resolve_attention_backend("triton", CUDA, features())


def test_forced_flash_attn_without_flash_attn_is_refused(monkeypatch):
    monkeypatch.setattr(
        selector, "_flash_attn_import_error", lambda: "ModuleNotFoundError: No module named 'x'"
    )
    good = features(block_size=256, dtype=torch.bfloat16)
    with pytest.raises(AttentionBackendUnavailableError) as caught:
        resolve_attention_backend("flash_attn", CUDA, good)
    message = str(caught.value)
    assert "hybrid-cache[flash-attn]" in message and "'triton'" in message
    assert isinstance(caught.value, HybridCacheError)
    # On the CPU the reason is the device, whatever is installed.
    with pytest.raises(AttentionBackendUnavailableError, match="CUDA only"):
        resolve_attention_backend("flash_attn", CPU, good)


def test_flash_attn_is_not_installed_in_this_environment():
    """The backend's own import probe says so, with the install hint (the fact the other
    flash-attn tests rely on to say 'untested here')."""
    with pytest.raises(AttentionBackendUnavailableError, match="not importable"):
        flash_attn_backend._varlen_function()


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(sinks=True), "attention sinks"),
        (dict(chunk=8), "chunked-local"),
        (dict(block_size=16), "multiple of 256"),
        (dict(block_size=384), "multiple of 256"),
        (dict(dtype=torch.float32), "float16/bfloat16"),
        (dict(head_dim=320), "head dims"),
    ],
)
def test_forced_flash_attn_refuses_what_fa2_cannot_do(fake_cuda_machine, change, fragment):
    good = dict(block_size=256, dtype=torch.bfloat16, sliding_window=128, softcap=50.0)
    assert resolve_attention_backend("flash_attn", CUDA, features(**good)) == "flash_attn"
    with pytest.raises(AttentionBackendUnavailableError, match=fragment):
        resolve_attention_backend("flash_attn", CUDA, features(**{**good, **change}))


def test_auto_on_cuda_prefers_flash_attn_then_triton(fake_cuda_machine, monkeypatch):
    fa_ready = features(block_size=512, dtype=torch.float16, sliding_window=4096, softcap=50.0)
    assert resolve_attention_backend("auto", CUDA, fa_ready) == "flash_attn"
    # One layer of the group that FA2 cannot serve moves the whole group to triton.
    assert resolve_attention_backend("auto", CUDA, [fa_ready, features(block_size=512,
        dtype=torch.float16, sinks=True)]) == "triton"  # fmt: skip
    assert resolve_attention_backend("auto", CUDA, features(block_size=16)) == "triton"
    assert resolve_attention_backend("auto", CUDA, features(block_size=256, chunk=8)) == "triton"
    monkeypatch.setattr(selector, "_flash_attn_import_error", lambda: "not installed")
    assert resolve_attention_backend("auto", CUDA, fa_ready) == "triton"
    monkeypatch.setattr(selector, "_triton_import_error", lambda: "not installed")
    assert resolve_attention_backend("auto", CUDA, fa_ready) == "torch"


def test_unknown_and_registered_names():
    with pytest.raises(UnknownAttentionBackendError, match="'auto'"):
        resolve_attention_backend("flash", CPU, features())
    # The existing registry API keeps working.
    assert get_attention_backend("reference") is reference
    assert get_attention_backend("torch") is torch_batched
    assert get_attention_backend() is reference
    assert get_attention_backend("triton") is triton_backend
    register_attention_backend("test-custom", reference)
    assert resolve_attention_backend("test-custom", CPU, features()) == "test-custom"
    with pytest.raises(UnknownAttentionBackendError):
        get_attention_backend("nope")


def test_flash_attn_backend_refuses_layers_it_cannot_run():
    """The backend itself refuses (typed) before importing flash_attn, whatever was selected."""
    seed = fresh_seed()
    metadata, layout, q, k, v, _ = paged_step(
        seed,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        sliding_window=None,
        chunk=None,
    )
    k_cache, v_cache = layout[:, 0], layout[:, 1]
    group = metadata.groups[0]
    cases = [
        (AttentionParams(0.25, sinks=torch.zeros(2)), "sinks"),
        (AttentionParams(0.25, chunk=8), "chunked-local"),
        (AttentionParams(0.25), "multiple of 256"),
    ]
    for params, fragment in cases:
        with pytest.raises(AttentionBackendUnavailableError, match=fragment):
            flash_attn_backend.paged_attention(q, k_cache, v_cache, metadata, group, params)
    group.block_size = 256  # past the block-size check: then the dtype and the device
    params = AttentionParams(0.25)
    with pytest.raises(AttentionBackendUnavailableError, match="float16/bfloat16"):
        flash_attn_backend.paged_attention(q, k_cache, v_cache, metadata, group, params)
    with pytest.raises(AttentionBackendUnavailableError, match="CUDA only"):
        flash_attn_backend.paged_attention(q.bfloat16(), k_cache, v_cache, metadata, group, params)


# ---------------------------------------------------------------- per-group selection and report


def tiny_model(preset: str):
    config = {**read_preset(preset), "num_hidden_layers": 2}
    config["layer_types"] = ["sliding_attention", "full_attention"]
    model = load_model(config=config, load_format="dummy", seed=1)
    # group 0: the windowed layer, group 1: full attention
    assign_layer_groups(model, [0, 1], [("sliding_window", 16), ("full", None)])
    return model


def test_select_sets_each_group_and_reports_it():
    model = tiny_model("tiny-gpt-oss")
    assert select_attention_backends(model, "auto", CPU, [4, 4]) == {0: "torch", 1: "torch"}
    assert select_attention_backends(model, "triton", CPU, [4, 4]) == {0: "triton", 1: "triton"}
    assert [layer.backend for layer in attention_layers(model)] == ["triton", "triton"]
    assert attention_backends_by_group(model) == {0: "triton", 1: "triton"}
    line = describe_attention_backends(model, [4, 4])
    assert "group 0 (sliding_window W=16, B=4): triton" in line
    assert "group 1 (full, B=4): triton" in line
    with pytest.raises(AttentionBackendUnavailableError, match="KV-cache group 0"):
        select_attention_backends(model, "flash_attn", CPU, [256, 256])
    # A refused selection changes no layer.
    assert attention_backends_by_group(model) == {0: "triton", 1: "triton"}


def test_select_detects_sinks_from_the_model(fake_cuda_machine):
    gpt_oss, gemma = tiny_model("tiny-gpt-oss"), tiny_model("tiny-gemma2")
    sizes, dtype = [256, 256], torch.bfloat16
    # gpt-oss holds a `sinks` parameter next to each Attention: FA2 cannot serve it.
    assert select_attention_backends(gpt_oss, "auto", CUDA, sizes, dtype) == {
        0: "triton",
        1: "triton",
    }
    with pytest.raises(AttentionBackendUnavailableError, match="sinks"):
        select_attention_backends(gpt_oss, "flash_attn", CUDA, sizes, dtype)
    # Gemma-2 (window + softcap, no sinks) suits it; the model spec's flag overrides detection.
    assert select_attention_backends(gemma, "auto", CUDA, sizes, dtype) == {
        0: "flash_attn",
        1: "flash_attn",
    }
    assert select_attention_backends(gemma, "auto", CUDA, sizes, dtype, attention_sinks=True) == {
        0: "triton",
        1: "triton",
    }
    # A block size that does not suit one group sends only that group to triton.
    assert select_attention_backends(gemma, "auto", CUDA, [256, 16], dtype) == {
        0: "flash_attn",
        1: "triton",
    }
