"""Planner: hand-computed layouts, the check of docs/DESIGN.md "Planning", presets, bad options."""

import math

import pytest
from hybrid_cache.config import ConfigError, LayerSpec, ModelSpec, load_model_spec
from hybrid_cache.errors import (
    BudgetTooSmallError,
    HybridCacheError,
    InvalidBlockSizeError,
    MemorySizeError,
    PlanError,
    WindowTooLargeError,
)
from hybrid_cache.planner import (
    GROUP_LAYOUTS,
    PER_TYPE_MAX_BLOCK_RATIO,
    PER_TYPE_MIN_CONCURRENCY,
    GroupLayout,
    PlanOptions,
    plan_kv_cache,
    report_plan,
)
from hybrid_cache.presets import preset_names
from hypothesis import given, settings
from hypothesis import strategies as st

GiB = 1024**3


def full(num_kv_heads=2, head_dim=16, dtype="bfloat16"):
    return LayerSpec("full", num_kv_heads, head_dim, head_dim, dtype)


def sliding(window, num_kv_heads=2, head_dim=16, dtype="bfloat16"):
    return LayerSpec("sliding_window", num_kv_heads, head_dim, head_dim, dtype, window=window)


def chunked(chunk, num_kv_heads=2, head_dim=16):
    return LayerSpec("chunked_local", num_kv_heads, head_dim, head_dim, "bfloat16", chunk=chunk)


def group_specs(layout):
    """(kind, block_size, window, chunk) of each group's coordinator spec."""
    return [(spec.kind, spec.block_size, spec.window, spec.chunk) for spec in layout.core_specs()]


def model_of(layers):
    return ModelSpec(
        name="hand",
        architecture="Hand",
        model_type="hand",
        num_layers=len(layers),
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=512,
        max_position_embeddings=1 << 20,
        dtype="bfloat16",
        layers=tuple(layers),
        attention_sinks=False,
        hf_config={},
        text_config={},
    )


def test_design_check_one_full_one_windowed_share_one_tensor():
    """docs/DESIGN.md "Planning": a full and a windowed layer, budget page x 2 x 32 = 64 blocks."""
    model = model_of([full(), sliding(32)])
    page = 16 * 2 * (16 + 16) * 2  # block size x kv heads x (K + V dims) x bf16 bytes
    layout = plan_kv_cache(model, PlanOptions(page * 2 * 32, max_model_len=1024))
    assert layout.page_bytes == page == 2048
    assert layout.layers_per_group == 1
    assert layout.num_blocks == 64
    assert layout.tensor_slots == (((0,), (1,)),), "both groups' layers live in the one slot tensor"
    assert layout.tensor_bytes * layout.layers_per_group == page * 64
    assert group_specs(layout) == [("full", 16, None, None), ("sliding_window", 16, 32, None)]
    assert layout.layer_slot(0) == (0, 0) and layout.layer_slot(1) == (1, 0)


def test_gemma2_like_alternating_layout_by_hand():
    model = model_of([sliding(64), full()] * 3)
    options = PlanOptions(10 * 2048 * 3, max_model_len=1024, max_num_batched_tokens=32)
    layout = plan_kv_cache(model, options)
    assert [g.layer_indices for g in layout.groups] == [(0, 2, 4), (1, 3, 5)]
    assert layout.layers_per_group == 3 and layout.num_blocks == 10
    assert layout.tensor_slots == (((0,), (1,)), ((2,), (3,)), ((4,), (5,)))
    report = report_plan(layout, model)
    # window: cdiv(min(63 + 32, 1024), 16) + 1 = 7; full: 1024 / 16 = 64
    assert report.blocks_per_request == 7 + 64
    assert report.max_concurrency == 0  # 9 usable blocks
    short = report_plan(layout, model, context_len=40)
    assert short.blocks_per_request == 3 + 3, "a short request never holds more than its tokens"
    assert short.max_concurrency == 1
    assert short.exact_bytes_per_request == 6 * 40 * 128
    assert short.allocated_bytes_per_request == 6 * 3 * 2048


def test_group_worst_case_formulas():
    window = GroupLayout(0, (0,), "sliding_window", 1024, None, 16, 4096, 4096)
    assert window.max_blocks_per_request(32768, 2048) == math.ceil(3071 / 16) + 1 == 193
    assert window.max_blocks_per_request(100, 2048) == 7
    chunk = GroupLayout(0, (0,), "chunked_local", None, 8192, 16, 4096, 4096)
    assert chunk.max_blocks_per_request(32768, 2048) == 641
    whole = GroupLayout(0, (0,), "full", None, None, 16, 4096, 4096)
    assert whole.max_blocks_per_request(32768, 2048) == 2048


def test_smaller_pages_get_larger_blocks():
    model = model_of([full(num_kv_heads=4), sliding(128, num_kv_heads=1)] * 2)
    layout = plan_kv_cache(model, PlanOptions(1 * GiB, max_model_len=4096))
    page = 16 * 4 * 32 * 2
    assert layout.page_bytes == page
    assert [(g.kind, g.block_size, g.used_page_bytes) for g in layout.groups] == [
        ("full", 16, page),
        ("sliding_window", 64, page),
    ]
    assert layout.notes == ()
    assert layout.num_blocks == GiB // page // 2


def test_non_dividing_pages_pad_and_report_the_waste():
    # 2048 B/token (4 heads x 256 x bf16) and 768 B/token (3 heads x 128 x bf16): 32768 B pages
    # hold 42 tokens of the small spec (32256 B); 512 B of each such page is padding.
    model = model_of([full(4, 128), sliding(256, 3, 64)])
    layout = plan_kv_cache(model, PlanOptions(1 * GiB, max_model_len=8192))
    assert layout.page_bytes == 32768
    small = layout.groups[1]
    assert (small.block_size, small.used_page_bytes) == (42, 42 * 768)
    assert any("pad their pages" in note for note in layout.notes)
    report = report_plan(layout, model)
    window_blocks = math.ceil((255 + 2048) / 42) + 1
    assert report.page_padding_bytes_per_request == window_blocks * 512
    assert report.efficiency < 1


def test_uneven_counts_pick_a_group_size_and_pad_within_the_limit():
    model = load_model_spec("gemma-3-27b")  # 52 sliding, 10 full
    layout = plan_kv_cache(model, PlanOptions(40 * GiB, max_model_len=32768))
    assert layout.layers_per_group == 5
    assert [len(g.layer_indices) for g in layout.groups] == [5] * 10 + [2] + [5, 5]
    assert layout.tensor_slots[4][10] == (), "slot 4 of the short group is padding"
    report = report_plan(layout, model)
    assert 0 < report.group_padding_bytes_per_request <= 0.02 * report.allocated_bytes_per_request
    assert report.blocks_per_request == 11 * 193 + 2 * 2048
    strict = plan_kv_cache(model, PlanOptions(40 * GiB, 32768, max_padding_waste=0))
    assert strict.layers_per_group == 2 and strict.num_groups == 31
    assert report_plan(strict, model).group_padding_bytes_per_request == 0


def test_layer_counts_that_are_multiples_use_the_smallest_count():
    model = model_of([sliding(32)] * 6 + [full()] * 2)
    layout = plan_kv_cache(model, PlanOptions(GiB, max_model_len=512, group_layout="equal"))
    assert layout.layers_per_group == 2 and layout.num_groups == 4
    auto = plan_kv_cache(model, PlanOptions(GiB, max_model_len=512))
    assert [g.block_size for g in auto.groups] == [16, 48], "auto: one group per type, 6:2"


def test_uniform_puts_every_layer_in_one_full_group():
    model = load_model_spec("gemma-2-9b")
    layout = plan_kv_cache(model, PlanOptions(40 * GiB, max_model_len=8192), "uniform")
    assert layout.num_groups == 1 and layout.layers_per_group == 42
    assert group_specs(layout) == [("full", 16, None, None)]
    page = 16 * 8 * 512 * 2
    assert layout.page_bytes == page and layout.num_blocks == 40 * GiB // page // 42


def ratio(name, length=32768, budget=40 * GiB):
    model = load_model_spec(name)
    options = PlanOptions(budget, max_model_len=length)
    hybrid = report_plan(plan_kv_cache(model, options, "hybrid"), model)
    uniform = report_plan(plan_kv_cache(model, options, "uniform"), model)
    return hybrid, uniform


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("gemma-3-27b", 4.0, 5.5),
        ("gemma-3-12b", 4.0, 5.5),
        ("gpt-oss-20b", 1.8, 2.0),
        ("gpt-oss-120b", 1.8, 2.0),
        ("gemma-2-9b", 1.6, 2.0),
        ("gemma-2-27b", 1.6, 2.0),
    ],
)
def test_hybrid_over_uniform_at_32k(name, low, high):
    hybrid, uniform = ratio(name)
    assert low <= hybrid.token_capacity / uniform.token_capacity <= high
    assert hybrid.max_concurrency >= low * uniform.max_concurrency - 1


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b"])
def test_all_full_models_are_exactly_one_x(name):
    hybrid, uniform = ratio(name)
    assert hybrid.max_concurrency == uniform.max_concurrency
    assert hybrid.blocks_per_request == uniform.blocks_per_request
    assert hybrid.efficiency == uniform.efficiency == 1.0


@pytest.mark.parametrize("name", [n for n in preset_names() if not n.startswith("tiny-")])
@pytest.mark.parametrize("length", [32768, 131072])
def test_long_context_efficiency_is_at_least_97_percent(name, length):
    hybrid, uniform = ratio(name, length, budget=80 * GiB)
    assert hybrid.efficiency >= 0.97
    assert hybrid.efficiency >= uniform.efficiency


def test_window_covering_the_context_is_planned_as_full():
    model = load_model_spec("mistral-7b")  # window 4096
    layout = plan_kv_cache(model, PlanOptions(GiB, max_model_len=4096))
    assert group_specs(layout) == [("full", 16, None, None)]
    assert any("never slide" in note for note in layout.notes)
    with pytest.raises(WindowTooLargeError, match="max-model-len"):
        plan_kv_cache(model, PlanOptions(GiB, max_model_len=4096, strict_windows=True))
    longer = plan_kv_cache(model, PlanOptions(GiB, max_model_len=4097, strict_windows=True))
    assert longer.groups[0].window == 4096


def test_kv_cache_dtype_changes_page_size():
    model = load_model_spec("llama-3.1-8b")
    bf16 = plan_kv_cache(model, PlanOptions(GiB, 8192))
    fp8 = plan_kv_cache(model, PlanOptions(GiB, 8192, kv_cache_dtype="fp8"))
    fp32 = plan_kv_cache(model, PlanOptions(GiB, 8192, kv_cache_dtype="fp32"))
    assert fp8.page_bytes * 2 == bf16.page_bytes == fp32.page_bytes // 2
    assert fp8.kv_cache_dtype == "float8_e4m3fn" and bf16.kv_cache_dtype == "bfloat16"


def test_chunked_layers_group_apart():
    model = model_of([chunked(64)] * 3 + [full()] * 3)
    layout = plan_kv_cache(model, PlanOptions(GiB, 4096))
    assert [(g.kind, g.chunk) for g in layout.groups] == [("chunked_local", 64), ("full", None)]


@pytest.mark.parametrize("name", preset_names())
@pytest.mark.parametrize("mode", ["hybrid", "uniform"])
def test_every_preset_plans(name, mode):
    model = load_model_spec(name)
    options = PlanOptions("24GiB", max_model_len=min(32768, model.max_position_embeddings))
    layout = plan_kv_cache(model, options, mode)
    check_invariants(model, layout)
    assert report_plan(layout, model).max_concurrency >= 1


def test_per_type_layout_one_group_per_layer_type_sharing_pages():
    """Gemma-3's 5:1 pattern: the five windowed layers share a page of 16-token blocks, the full
    layer gets the same page as one 80-token block; "auto" takes it (2 groups instead of 6)."""
    model = load_model_spec("tiny-gemma3")  # 5 sliding (W=16) + 1 full, 1 kv head x 32, fp32
    per_token = 2 * 1 * 32 * 4
    layout = plan_kv_cache(model, PlanOptions("15.25MiB", max_model_len=1024))
    assert [(g.kind, g.layer_indices, g.block_size) for g in layout.groups] == [
        ("sliding_window", (0, 1, 2, 3, 4), 16),
        ("full", (5,), 80),
    ]
    assert [g.layers_per_page for g in layout.groups] == [5, 1]
    assert layout.page_bytes == 16 * 5 * per_token == 80 * per_token
    assert layout.layers_per_group == 1 and layout.tensor_slots == (((0, 1, 2, 3, 4), (5,)),)
    assert layout.num_blocks == int(15.25 * 2**20) // layout.page_bytes
    assert layout.layer_slot(3) == (0, 0) and layout.layer_slot(5) == (1, 0)
    check_invariants(model, layout)
    equal = plan_kv_cache(model, PlanOptions("15.25MiB", 1024, group_layout="equal"))
    assert [len(g.layer_indices) for g in equal.groups] == [1] * 6
    assert [g.block_size for g in equal.groups] == [16] * 6
    ours, theirs = report_plan(layout, model), report_plan(equal, model)
    assert ours.page_padding_bytes_per_request == ours.group_padding_bytes_per_request == 0
    # Same budget, same bytes per token: the full layer's coarser blocks cost at most one block.
    assert ours.allocated_bytes_per_request <= theirs.allocated_bytes_per_request + 80 * per_token
    assert ours.max_concurrency >= theirs.max_concurrency - 1


def test_auto_keeps_equal_groups_when_per_type_pads_or_gains_nothing():
    # 52 sliding, 10 full: 16 x 52 / 10 = 83.2 tokens fit a full layer's share of the page; the
    # block is rounded down to 80 (a multiple of 16: prefix hits align to 80, not lcm(16, 83)),
    # so the full group's pages pad 3.8%.
    gemma3_27b = load_model_spec("gemma-3-27b")
    forced = plan_kv_cache(
        gemma3_27b, PlanOptions(40 * GiB, max_model_len=32768, group_layout="per-type")
    )
    assert [g.block_size for g in forced.groups] == [16, 80]
    assert forced.groups[1].used_page_bytes * 52 == forced.page_bytes * 50
    assert any("pad their pages" in note for note in forced.notes)
    report = report_plan(forced, gemma3_27b)
    assert 0.02 < report.page_padding_bytes_per_request / report.allocated_bytes_per_request
    check_invariants(gemma3_27b, forced)
    # Auto weighs that padding like the equal-size rule weighs empty slots (max_padding_waste of
    # a max-length request): over 2% at 32k (full layers hold most of a request), under at 8k.
    assert plan_kv_cache(gemma3_27b, PlanOptions(40 * GiB, 32768)).layers_per_group == 5
    short = plan_kv_cache(gemma3_27b, PlanOptions(40 * GiB, 8192))
    assert [g.block_size for g in short.groups] == [16, 80]
    padding = report_plan(short, gemma3_27b)
    assert 0 < padding.page_padding_bytes_per_request <= 0.02 * padding.allocated_bytes_per_request
    strict = PlanOptions(40 * GiB, 8192, max_padding_waste=0.0)
    assert plan_kv_cache(gemma3_27b, strict).num_groups == 31
    # 1:1 patterns already have one group per type: auto changes nothing.
    gemma2 = load_model_spec("gemma-2-27b")
    assert plan_kv_cache(gemma2, PlanOptions(40 * GiB, 8192)).layers_per_group == 23
    # One full layer among nine windowed: a 144-token full block is over the ratio.
    nine = model_of([sliding(64)] * 9 + [full()])
    assert PER_TYPE_MAX_BLOCK_RATIO * 16 < 9 * 16
    assert plan_kv_cache(nine, PlanOptions(GiB, 4096)).num_groups == 10
    forced_nine = plan_kv_cache(nine, PlanOptions(GiB, 4096, group_layout="per-type"))
    assert [g.block_size for g in forced_nine.groups] == [16, 144]
    # Blocks stay multiples of the requested size when pages do not divide (7:2 -> 56 / 16 * 16).
    seven = model_of([sliding(64)] * 7 + [full()] * 2)
    forced_seven = plan_kv_cache(seven, PlanOptions(GiB, 4096, group_layout="per-type"))
    assert [g.block_size for g in forced_seven.groups] == [16, 48]


def test_auto_declines_per_type_blocks_where_a_small_pool_pays_for_them_in_prefix_hits():
    """Tiny Gemma-3 with windows of 64 at 576 tokens (the multi-turn benchmark): a 2.5 MiB pool
    holds 2 requests, and the 80-token full-attention blocks may waste 2 x 64 token slots per
    request (a cached prefix's last block, a shared prefix ending inside a block), 3.6% of
    one: "auto" keeps equal groups. The same model at 15.25 MiB and 640 tokens (windows of 16,
    `bench_cpu.sh`) holds 16 requests, and a long context makes the waste negligible: per-type."""
    per_token = 2 * 1 * 32 * 4
    windows_64 = load_model_spec("tiny-gemma3", {"sliding_window": 64})
    tight = plan_kv_cache(windows_64, PlanOptions("2.5MiB", max_model_len=576))
    assert [(len(g.layer_indices), g.block_size) for g in tight.groups] == [(1, 16)] * 6
    assert any("too few for its coarser blocks" in note for note in tight.notes), tight.notes
    forced = plan_kv_cache(windows_64, PlanOptions("2.5MiB", 576, group_layout="per-type"))
    assert [g.block_size for g in forced.groups] == [16, 80]
    report = report_plan(forced, windows_64)
    assert report.max_concurrency == 2 < PER_TYPE_MIN_CONCURRENCY
    waste = 2 * (80 - 16) * per_token
    assert waste > 0.02 * report.allocated_bytes_per_request
    # A waste bound that covers it, or a pool of 8 requests, keeps the per-type layout.
    lenient = PlanOptions("2.5MiB", 576, max_padding_waste=0.05)
    assert plan_kv_cache(windows_64, lenient).num_groups == 2
    blocks_per_request = report.blocks_per_request
    roomy = (PER_TYPE_MIN_CONCURRENCY * blocks_per_request + 1) * forced.page_bytes
    assert plan_kv_cache(windows_64, PlanOptions(roomy, 576)).num_groups == 2
    assert plan_kv_cache(windows_64, PlanOptions(roomy - forced.page_bytes, 576)).num_groups == 6
    bench_cpu = plan_kv_cache(load_model_spec("tiny-gemma3"), PlanOptions("15.25MiB", 640))
    assert [g.block_size for g in bench_cpu.groups] == [16, 80]
    # Gemma-3-12B at its 128k context: 4 requests in 40 GiB, but 2 x 64 token slots of 8 full
    # layers are nothing next to a 128k-token request.
    gemma3_12b = load_model_spec("gemma-3-12b")
    long = plan_kv_cache(gemma3_12b, PlanOptions(40 * GiB, 131072))
    assert [g.block_size for g in long.groups] == [16, 80]
    assert report_plan(long, gemma3_12b).max_concurrency < PER_TYPE_MIN_CONCURRENCY


def test_group_layout_must_be_known():
    with pytest.raises(PlanError, match="group_layout must be one of auto, equal, per-type"):
        PlanOptions(GiB, 1024, group_layout="sideways")


def check_invariants(model, layout):
    placed = [layer for slot in layout.tensor_slots for members in slot for layer in members]
    assert sorted(placed) == list(range(model.num_layers)), "every layer in exactly one slot"
    assert all(g.num_slots <= layout.layers_per_group for g in layout.groups)
    assert all(g.used_page_bytes <= g.page_bytes == layout.page_bytes for g in layout.groups)
    budget = layout.options.kv_cache_memory
    assert layout.num_blocks * layout.page_bytes * layout.layers_per_group <= budget
    for layer in range(model.num_layers):
        group_id, slot = layout.layer_slot(layer)
        assert layer in layout.tensor_slots[slot][group_id]


layer_strategy = st.builds(
    lambda kind, reach, heads, dim: LayerSpec(
        kind,
        heads,
        dim,
        dim,
        "bfloat16",
        window=reach if kind == "sliding_window" else None,
        chunk=reach if kind == "chunked_local" else None,
    ),
    st.sampled_from(["full", "sliding_window", "chunked_local"]),
    st.integers(1, 5000),
    st.integers(1, 8),
    st.sampled_from([16, 48, 64, 80, 128]),
)


@settings(max_examples=150, deadline=None)
@given(
    layers=st.lists(layer_strategy, min_size=1, max_size=24),
    block_size=st.sampled_from([1, 8, 16, 64]),
    max_model_len=st.integers(1, 40000),
    mode=st.sampled_from(["hybrid", "uniform"]),
    group_layout=st.sampled_from(GROUP_LAYOUTS),
)
def test_random_models_plan_consistently(layers, block_size, max_model_len, mode, group_layout):
    model = model_of(layers)
    options = PlanOptions(4 * GiB, max_model_len, block_size=block_size, group_layout=group_layout)
    layout = plan_kv_cache(model, options, mode)
    check_invariants(model, layout)
    report = report_plan(layout, model)
    assert 0 < report.efficiency <= 1
    assert report.exact_bytes_per_request <= report.allocated_bytes_per_request
    assert (
        report.group_padding_bytes_per_request + report.page_padding_bytes_per_request
        <= report.allocated_bytes_per_request - report.exact_bytes_per_request
    )


@pytest.mark.parametrize("block_size", [0, -16, 24, 3, True, 16.0])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(InvalidBlockSizeError, match="power of two"):
        PlanOptions(GiB, 1024, block_size=block_size)


def test_budget_smaller_than_one_block_per_group():
    model = model_of([full(), sliding(32)])
    with pytest.raises(BudgetTooSmallError, match="at least 6144 bytes"):
        plan_kv_cache(model, PlanOptions(6143, 1024))
    assert plan_kv_cache(model, PlanOptions(6144, 1024)).num_blocks == 3


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"kv_cache_memory": "lots"}, MemorySizeError),
        ({"max_model_len": 0}, PlanError),
        ({"max_num_batched_tokens": -1}, PlanError),
        ({"max_padding_waste": 1.0}, PlanError),
        ({"kv_cache_dtype": "int4"}, ConfigError),
    ],
)
def test_bad_options_raise_typed_errors(kwargs, error):
    arguments = {"kv_cache_memory": GiB, "max_model_len": 1024, **kwargs}
    with pytest.raises(error) as caught:
        PlanOptions(**arguments)
    assert isinstance(caught.value, (HybridCacheError, ValueError))


def test_bad_mode_and_context():
    model = model_of([full()])
    with pytest.raises(PlanError, match="mode"):
        plan_kv_cache(model, PlanOptions(GiB, 1024), "paged")
    with pytest.raises(PlanError, match="context length"):
        report_plan(plan_kv_cache(model, PlanOptions(GiB, 1024)), model, context_len=0)
    with pytest.raises(PlanError, match="not in this layout"):
        plan_kv_cache(model, PlanOptions(GiB, 1024)).layer_slot(5)
