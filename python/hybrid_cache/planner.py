"""KV-cache planning: from a model's layers and a memory budget to the layout the engine allocates.

Why this shape (docs/DESIGN.md "Planning", docs/PLANNER.md for the worked examples):

* Layers with one memory spec (attention kind, window/chunk, bytes per token) form **groups of
  equal size** `layers_per_group`; each group has its own block table, so a windowed group frees
  what slid out of its window while full-attention groups keep everything.
* All groups draw from **one pool of block ids**. Block id b of group k lives at page b of each of
  the group's layer tensors; the layer tensors are **shared by slot** across groups: slot j holds
  the j-th layer of every group, so memory = layers_per_group tensors of num_blocks pages.
* That needs **one page size** (bytes per block per layer). The largest bytes-per-token spec gets
  the requested block size; every other spec gets the most tokens that fit in that page,
  `block_size = page_bytes // bytes_per_token` (the ratio when pages divide; otherwise the rest
  of the page is padding, reported as waste).
* When a spec's layer count is not a multiple of the group size, its last group is padded with
  empty slots (their pages are allocated and unused). The group size is the largest one, at most
  the smallest layer count, whose padding costs at most `max_padding_waste` of a max-length
  request's memory (group size 1 never pads, so one always qualifies).
* `group_layout="per-type"` instead makes **one group per spec**, all its layers side by side in
  one page of a single slot tensor: the spec with the most bytes per token over all its layers
  gets the requested block size, the others the largest multiple of it that fits the page
  (Gemma-3's 5:1 pattern: windowed layers in blocks of 16 tokens, full layers of 80). Fewer
  groups means fewer block tables, allocations and kernel plans per step; the price is coarser
  blocks for the lighter specs (prefix hits align to the largest block).
  `"auto"` (the default) takes it when it has fewer groups than the equal-size layout, its page
  padding stays within `max_padding_waste` (as for equal groups), no block exceeds
  `PER_TYPE_MAX_BLOCK_RATIO` x the requested size, and the pool holds at least
  `PER_TYPE_MIN_CONCURRENCY` requests of `max_model_len` or its coarser blocks waste at most
  `max_padding_waste` of such a request (in a small pool a cached prefix's unfilled last block
  and a shared prefix that ends inside a block cost more prefix hits than fewer groups save).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, Optional, Union

from hybrid_cache import _core
from hybrid_cache.checks import check_block_size, check_choice, check_positive_int
from hybrid_cache.config import AttentionKind, LayerSpec, ModelSpec, normalize_dtype
from hybrid_cache.errors import BudgetTooSmallError, PlanError, WindowTooLargeError
from hybrid_cache.sizes import format_memory_size, parse_memory_size

PlanMode = Literal["hybrid", "uniform"]
PLAN_MODES: tuple[str, ...] = ("hybrid", "uniform")
GroupLayoutChoice = Literal["auto", "equal", "per-type"]
GROUP_LAYOUTS: tuple[str, ...] = ("auto", "equal", "per-type")

# The defaults of the plan options, here only (`EngineConfig` and the CLI take them from here).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_PADDING_WASTE = 0.02
# "auto" keeps per-type blocks within this many times the requested block size.
PER_TYPE_MAX_BLOCK_RATIO = 8
# "auto" declines the per-type layout when its pool holds fewer requests of max_model_len than
# this and its coarser blocks waste over max_padding_waste of one (docs/PLANNER.md "Per-type
# layout": there memory decides throughput and prefix reuse, not the per-group step cost).
PER_TYPE_MIN_CONCURRENCY = 8


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(frozen=True)
class PlanOptions:
    """Everything a plan depends on besides the model. `kv_cache_memory` takes bytes or a size
    string (`"40GiB"`); `kv_cache_dtype="auto"` uses the model's dtype. A window or chunk of at
    least `max_model_len` never slides, so its layers are planned as full attention (exact, no
    waste) unless `strict_windows` asks for a `WindowTooLargeError` instead. `group_layout`:
    "equal" (equal-size groups), "per-type" (one group per memory spec) or "auto" (see the
    module docstring)."""

    kv_cache_memory: Union[int, str]
    max_model_len: int
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_padding_waste: float = DEFAULT_MAX_PADDING_WASTE
    strict_windows: bool = False
    group_layout: GroupLayoutChoice = "auto"

    def __post_init__(self) -> None:
        check_choice(self.group_layout, GROUP_LAYOUTS, "group_layout", PlanError)
        object.__setattr__(self, "kv_cache_memory", parse_memory_size(self.kv_cache_memory))
        check_block_size(self.block_size)
        for name in ("max_model_len", "max_num_batched_tokens"):
            check_positive_int(getattr(self, name), name, PlanError)
        if not 0 <= self.max_padding_waste < 1:
            raise PlanError(f"max_padding_waste must be in [0, 1), got {self.max_padding_waste}")
        if self.kv_cache_dtype != "auto":
            object.__setattr__(self, "kv_cache_dtype", normalize_dtype(self.kv_cache_dtype))


@dataclass(frozen=True)
class _MemorySpec:
    """What decides a layer's group: layers equal here can share one block table."""

    kind: AttentionKind
    window: Optional[int]
    chunk: Optional[int]
    bytes_per_token: int


@dataclass(frozen=True)
class GroupLayout:
    """One group: its layers (padded slots hold nothing), attention kind and block size.
    `layers_per_page` of its layers share each page of a slot tensor (1, or all of them in the
    per-type layout); they use `used_page_bytes` of each `page_bytes` page, the rest is page
    padding."""

    group_id: int
    layer_indices: tuple[int, ...]
    kind: AttentionKind
    window: Optional[int]
    chunk: Optional[int]
    block_size: int
    page_bytes: int
    used_page_bytes: int
    layers_per_page: int = 1

    @property
    def num_slots(self) -> int:
        """Slot tensors this group's layers occupy."""
        return cdiv(len(self.layer_indices), self.layers_per_page)

    @property
    def reach(self) -> Optional[int]:
        """The window or chunk (None for full attention)."""
        return self.window if self.kind == "sliding_window" else self.chunk

    def core_spec(self) -> _core.GroupSpec:
        """The coordinator's spec of this group."""
        return _core.GroupSpec(self.kind, self.block_size, window=self.window, chunk=self.chunk)

    def max_blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Worst-case blocks a request of `num_tokens` tokens holds at once in this group: the
        window (or chunk) plus one step of new tokens, plus one block of misalignment. The
        core's own bound (`_core.worst_case_live_blocks`, what admission checks)."""
        return _core.worst_case_live_blocks(
            self.block_size, self.reach, num_tokens, max_num_batched_tokens
        )


@dataclass(frozen=True)
class KVCacheLayout:
    """The plan the engine allocates: `layers_per_group` tensors (slots) of `num_blocks` pages of
    `page_bytes` each; `tensor_slots[j][k]` are the layers of group k stored side by side in
    each page of slot j (one layer, or none for a padded slot; all of the group's layers in the
    per-type layout, which has one slot). Block 0 is the null block, so `num_blocks - 1` blocks
    are usable."""

    mode: PlanMode
    groups: tuple[GroupLayout, ...]
    page_bytes: int
    num_blocks: int
    layers_per_group: int
    tensor_slots: tuple[tuple[tuple[int, ...], ...], ...]
    kv_cache_dtype: str
    options: PlanOptions
    notes: tuple[str, ...] = field(default=())

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one slot tensor; the whole cache is `layers_per_group` of them."""
        return self.num_blocks * self.page_bytes

    def core_specs(self) -> list[_core.GroupSpec]:
        """The coordinator's `GroupSpec` of each group, in group-id order."""
        return [group.core_spec() for group in self.groups]

    def tail_replay_tokens(self) -> Optional[int]:
        """R of a tail replay: the tokens before a full-attention hit point that the windowed
        layers recompute to rebuild their windows there exactly. Layer l's keys depend on the
        tokens its window W_l reaches through the windowed layers below it, so the sum of
        W_l - 1 over the windowed layers suffices. None where replay does not apply: no
        full-attention or no sliding-window group, or a chunked-local group."""
        kinds = {group.kind for group in self.groups}
        if "full" not in kinds or "sliding_window" not in kinds or "chunked_local" in kinds:
            return None
        return sum(
            len(group.layer_indices) * (group.window - 1)
            for group in self.groups
            if group.kind == "sliding_window" and group.window is not None
        )

    def group_attention(self) -> list[tuple[AttentionKind, Optional[int]]]:
        """(kind, window or chunk) per group, in group-id order (`assign_layer_groups`)."""
        return [(group.kind, group.reach) for group in self.groups]

    @property
    def full_accepts_reach(self) -> int:
        """The smallest window/chunk a layer planned into a full-attention group may have: a
        window that covers `max_model_len` never slides; in uniform mode every group is full."""
        return 1 if self.mode == "uniform" else self.options.max_model_len

    def layer_slot(self, layer_index: int) -> tuple[int, int]:
        """(group id, slot) of a layer: which block table it reads and which tensor it writes."""
        for slot, layers in enumerate(self.tensor_slots):
            for group_id, members in enumerate(layers):
                if layer_index in members:
                    return group_id, slot
        raise PlanError(f"layer {layer_index} is not in this layout")


# ---------------------------------------------------------------------------------------------


def _memory_specs(model: ModelSpec, options: PlanOptions, notes: list[str]) -> list[_MemorySpec]:
    """Each layer's memory spec in the cache dtype; windows covering the whole context -> full."""
    kv_dtype = None if options.kv_cache_dtype == "auto" else options.kv_cache_dtype
    specs = []
    demoted = []
    for index, layer in enumerate(model.layers):
        kind, window, chunk, reach = layer.kind, layer.window, layer.chunk, layer.reach
        if reach is not None and reach >= options.max_model_len:
            if options.strict_windows:
                raise WindowTooLargeError(
                    f"layer {index}: {layer.kind} size {reach} >= max_model_len "
                    f"{options.max_model_len}, so it never slides; raise --max-model-len above "
                    f"{reach} or drop --strict-windows to plan it as full attention"
                )
            kind, window, chunk = "full", None, None
            demoted.append(index)
        specs.append(_MemorySpec(kind, window, chunk, layer.bytes_per_token(kv_dtype)))
    if demoted:
        notes.append(
            f"{len(demoted)} windowed layers have a window >= max_model_len "
            f"{options.max_model_len}: planned as full attention (exact: they never slide)"
        )
    return specs


def _group_size(
    layers_by_spec: dict[_MemorySpec, list[int]],
    blocks_by_spec: dict[_MemorySpec, int],
    max_padding_waste: float,
) -> int:
    """Largest group size <= the smallest layer count whose padded slots cost at most
    `max_padding_waste` of a max-length request's pages."""
    smallest = min(len(layers) for layers in layers_by_spec.values())
    for size in range(smallest, 0, -1):
        allocated = padded = 0
        for spec, layers in layers_by_spec.items():
            num_slots = cdiv(len(layers), size) * size
            allocated += num_slots * blocks_by_spec[spec]
            padded += (num_slots - len(layers)) * blocks_by_spec[spec]
        if padded <= max_padding_waste * allocated:
            return size
    raise AssertionError("group size 1 never pads, so the loop always returns")


def plan_kv_cache(
    model: ModelSpec, options: PlanOptions, mode: PlanMode = "hybrid"
) -> KVCacheLayout:
    """Plans the KV cache of `model` (see the module docstring for the rules)."""
    check_choice(mode, PLAN_MODES, "mode", PlanError)
    notes: list[str] = []
    if options.max_model_len > model.max_position_embeddings:
        notes.append(
            f"max_model_len {options.max_model_len} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings}"
        )
    specs = _memory_specs(model, options, notes)
    if mode == "uniform":
        widest = max(spec.bytes_per_token for spec in specs)
        specs = [_MemorySpec("full", None, None, widest)] * len(specs)

    layers_by_spec: dict[_MemorySpec, list[int]] = {}
    for index, spec in enumerate(specs):
        layers_by_spec.setdefault(spec, []).append(index)
    if options.group_layout != "equal" and len(layers_by_spec) > 1:
        per_type = _per_type_layout(layers_by_spec, options)
        forced = options.group_layout == "per-type"
        if forced or _per_type_pays(per_type, layers_by_spec, options):
            sizes = ", ".join(f"{group.kind} B={group.block_size}" for group in per_type)
            notes.append(f"per-type layout: one group per layer type ({sizes})")
            return _finish_layout(model, options, mode, per_type, 1, notes)
        if _per_type_costs_hits(per_type, options):
            notes.append(
                "equal groups: the per-type layout's pool would hold "
                f"{_per_type_concurrency(per_type, options)} requests of "
                f"{options.max_model_len} tokens, too few for its coarser blocks "
                "(docs/PLANNER.md; --kv-group-layout per-type forces it)"
            )
    widest = max(spec.bytes_per_token for spec in layers_by_spec)
    page_bytes = options.block_size * widest
    block_size_by_spec = {spec: page_bytes // spec.bytes_per_token for spec in layers_by_spec}
    blocks_by_spec = {
        spec: _group_for(spec, (), 0, block_size_by_spec[spec], page_bytes).max_blocks_per_request(
            options.max_model_len, options.max_num_batched_tokens
        )
        for spec in layers_by_spec
    }
    layers_per_group = _group_size(layers_by_spec, blocks_by_spec, options.max_padding_waste)

    groups: list[GroupLayout] = []
    for spec, layers in layers_by_spec.items():
        for start in range(0, len(layers), layers_per_group):
            members = tuple(layers[start : start + layers_per_group])
            groups.append(
                _group_for(spec, members, len(groups), block_size_by_spec[spec], page_bytes)
            )
    return _finish_layout(model, options, mode, groups, layers_per_group, notes)


def _per_type_layout(
    layers_by_spec: dict[_MemorySpec, list[int]], options: PlanOptions
) -> list[GroupLayout]:
    """One group per spec, its layers side by side in one page: the spec with the most bytes per
    token over all its layers gets the requested block size, every other the largest multiple
    of it that fits the page (so prefix hits align to the largest block, not to an odd least
    common multiple: Gemma-3-27B's 52:10 gives 80, not 83, and 1328-token alignment)."""
    weight = {spec: len(layers) * spec.bytes_per_token for spec, layers in layers_by_spec.items()}
    page_bytes = options.block_size * max(weight.values())
    return [
        _group_for(
            spec,
            tuple(layers),
            group_id,
            page_bytes // weight[spec] // options.block_size * options.block_size,
            page_bytes,
            layers_per_page=len(layers),
        )
        for group_id, (spec, layers) in enumerate(layers_by_spec.items())
    ]


def _per_type_pays(
    per_type: list[GroupLayout], layers_by_spec: dict[_MemorySpec, list[int]], options: PlanOptions
) -> bool:
    """Whether "auto" takes the per-type layout: fewer groups than equal-size groups can have
    (at best one group per spec and per smallest layer count), page padding within
    `max_padding_waste` of a max-length request's pages (the equal-size rule's bound), no
    block above `PER_TYPE_MAX_BLOCK_RATIO` x the requested size, and a pool of at least
    `PER_TYPE_MIN_CONCURRENCY` max-length requests."""
    smallest = min(len(layers) for layers in layers_by_spec.values())
    fewest_equal_groups = sum(cdiv(len(layers), smallest) for layers in layers_by_spec.values())
    allocated = padded = 0
    for group in per_type:
        blocks = group.max_blocks_per_request(options.max_model_len, options.max_num_batched_tokens)
        allocated += blocks * group.page_bytes
        padded += blocks * (group.page_bytes - group.used_page_bytes)
    return (
        len(per_type) < fewest_equal_groups
        and padded <= options.max_padding_waste * allocated
        and max(group.block_size for group in per_type)
        <= PER_TYPE_MAX_BLOCK_RATIO * options.block_size
        and not _per_type_costs_hits(per_type, options)
    )


def _per_type_costs_hits(per_type: list[GroupLayout], options: PlanOptions) -> bool:
    """Whether the per-type layout's coarser blocks cost prefix hits that "auto" will not pay:
    its pool holds fewer than `PER_TYPE_MIN_CONCURRENCY` requests of `max_model_len`, and what
    the blocks longer than the requested size may waste per request, twice the extra tokens of
    each (a cached prefix's last block, and a prefix shared with other requests that ends inside
    a block), is over `max_padding_waste` of such a request's pages."""
    if _per_type_concurrency(per_type, options) >= PER_TYPE_MIN_CONCURRENCY:
        return False
    allowed = options.max_padding_waste * _request_bytes(per_type, options)
    return _granularity_bytes(per_type, options) > allowed


def _per_type_concurrency(per_type: list[GroupLayout], options: PlanOptions) -> int:
    """Requests of `max_model_len` the per-type layout's pool holds at once (its one slot
    tensor has `budget // page_bytes` blocks, block 0 the null block)."""
    usable = options.kv_cache_memory // per_type[0].page_bytes - 1
    blocks = sum(
        group.max_blocks_per_request(options.max_model_len, options.max_num_batched_tokens)
        for group in per_type
    )
    return max(usable, 0) // blocks


def _granularity_bytes(per_type: list[GroupLayout], options: PlanOptions) -> int:
    """Bytes per request the per-type blocks may waste beyond blocks of the requested size:
    `2 x (B_g - B)` token slots of each group g with longer blocks."""
    return sum(
        2 * (group.block_size - options.block_size) * group.used_page_bytes // group.block_size
        for group in per_type
    )


def _request_bytes(per_type: list[GroupLayout], options: PlanOptions) -> int:
    """Pages a request of `max_model_len` holds at worst in the per-type layout, in bytes."""
    return sum(
        group.max_blocks_per_request(options.max_model_len, options.max_num_batched_tokens)
        * group.page_bytes
        for group in per_type
    )


def _finish_layout(
    model: ModelSpec,
    options: PlanOptions,
    mode: PlanMode,
    groups: list[GroupLayout],
    layers_per_group: int,
    notes: list[str],
) -> KVCacheLayout:
    """The layout of `groups` over `layers_per_group` slot tensors: slot j holds each group's
    j-th page of layers; the budget sets the number of blocks."""
    page_bytes = groups[0].page_bytes
    if any(group.used_page_bytes < page_bytes for group in groups):
        notes.append("page sizes do not divide: some groups pad their pages (see page waste)")
    tensor_slots = tuple(
        tuple(g.layer_indices[j * g.layers_per_page : (j + 1) * g.layers_per_page] for g in groups)
        for j in range(layers_per_group)
    )
    num_blocks = options.kv_cache_memory // page_bytes // layers_per_group
    if num_blocks < len(groups) + 1:
        minimum = (len(groups) + 1) * page_bytes * layers_per_group
        raise BudgetTooSmallError(
            f"kv cache memory {format_memory_size(options.kv_cache_memory)} holds {num_blocks} "
            f"blocks of {layers_per_group} x {page_bytes} B; {len(groups)} groups need at least "
            f"{len(groups) + 1} (one each plus the null block): give at least {minimum} bytes "
            f"({format_memory_size(minimum)}) or a smaller --block-size"
        )
    kv_dtype = options.kv_cache_dtype if options.kv_cache_dtype != "auto" else model.dtype
    return KVCacheLayout(
        mode=mode,
        groups=tuple(groups),
        page_bytes=page_bytes,
        num_blocks=num_blocks,
        layers_per_group=layers_per_group,
        tensor_slots=tensor_slots,
        kv_cache_dtype=kv_dtype,
        options=options,
        notes=tuple(notes),
    )


def _group_for(
    spec: _MemorySpec,
    layers: tuple[int, ...],
    group_id: int,
    block_size: int,
    page_bytes: int,
    layers_per_page: int = 1,
) -> GroupLayout:
    return GroupLayout(
        group_id=group_id,
        layer_indices=layers,
        kind=spec.kind,
        window=spec.window,
        chunk=spec.chunk,
        block_size=block_size,
        page_bytes=page_bytes,
        used_page_bytes=block_size * spec.bytes_per_token * layers_per_page,
        layers_per_page=layers_per_page,
    )


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanReport:
    """What a layout gives at one context length. Per-request figures are the worst case
    (window + one step of `max_num_batched_tokens` for windowed groups). `exact_bytes_per_request`
    counts the KV bytes of the tokens each layer must keep (the model's windows, whatever the
    layout); `efficiency` is that over the bytes allocated for the request."""

    mode: PlanMode
    context_len: int
    num_blocks: int
    blocks_per_request: int
    max_concurrency: int
    token_capacity: int
    exact_bytes_per_request: int
    allocated_bytes_per_request: int
    group_padding_bytes_per_request: int
    page_padding_bytes_per_request: int
    efficiency: float


def layer_tokens_kept(layer: LayerSpec, context_len: int, max_num_batched_tokens: int) -> int:
    """Tokens of KV a layer must hold at once for a request of `context_len` tokens (the core's
    `worst_case_live_tokens`)."""
    return _core.worst_case_live_tokens(layer.reach, context_len, max_num_batched_tokens)


def report_plan(
    layout: KVCacheLayout, model: ModelSpec, context_len: Optional[int] = None
) -> PlanReport:
    """Capacity, concurrency and efficiency of `layout` at `context_len` (default max_model_len).

    `token_capacity` is the context the pool holds when filled with requests of `context_len`
    tokens: `(num_blocks - 1) * context_len / blocks_per_request` (block 0 is the null block).
    """
    options = layout.options
    context_len = options.max_model_len if context_len is None else context_len
    if context_len <= 0:
        raise PlanError(f"context length must be positive, got {context_len}")
    batched = options.max_num_batched_tokens
    kv_dtype = None if options.kv_cache_dtype == "auto" else options.kv_cache_dtype
    exact = sum(
        layer_tokens_kept(layer, context_len, batched) * layer.bytes_per_token(kv_dtype)
        for layer in model.layers
    )
    blocks_per_request = allocated = group_padding = page_padding = 0
    for group in layout.groups:
        num_blocks = group.max_blocks_per_request(context_len, batched)
        num_empty_slots = layout.layers_per_group - group.num_slots
        blocks_per_request += num_blocks
        allocated += num_blocks * layout.layers_per_group * layout.page_bytes
        group_padding += num_blocks * num_empty_slots * layout.page_bytes
        page_padding += num_blocks * group.num_slots * (layout.page_bytes - group.used_page_bytes)
    usable_blocks = layout.num_blocks - 1
    return PlanReport(
        mode=layout.mode,
        context_len=context_len,
        num_blocks=layout.num_blocks,
        blocks_per_request=blocks_per_request,
        max_concurrency=usable_blocks // blocks_per_request,
        token_capacity=int(Fraction(usable_blocks * context_len, blocks_per_request)),
        exact_bytes_per_request=exact,
        allocated_bytes_per_request=allocated,
        group_padding_bytes_per_request=group_padding,
        page_padding_bytes_per_request=page_padding,
        efficiency=exact / allocated,
    )
