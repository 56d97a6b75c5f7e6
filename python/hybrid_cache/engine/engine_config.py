"""`EngineConfig`: every argument an engine is built from, validated once, and its command-line
flags (`add_engine_arguments` / `engine_config_from_args`, shared by `generate`, `bench` and,
for the model and plan options, `plan`).

    config = EngineConfig("tiny-gemma3", kv_cache_memory="8MiB", max_num_seqs=16)
    llm = LLM(config)                     # the same as LLM("tiny-gemma3", kv_cache_memory=...)

Defaults live here (`DEFAULT_MAX_NUM_SEQS`, ...) and, for the plan options, in `planner.py`;
nothing else restates them. A bad field raises a typed error whose message names its flag and
its `LLM` argument: `PlanError` (an `EngineConfigError`; `InvalidBlockSizeError` for the block
size) for the plan options, `MemorySizeError` for a size, `ConfigError` for `hf_overrides` or
`dtype`, `EngineConfigError` for the rest. This module imports neither torch nor the engine, so
`hybrid-cache plan` stays light.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from hybrid_cache.checks import (
    check_block_size,
    check_bool,
    check_choice,
    check_positive_int,
    is_int,
    is_real,
)
from hybrid_cache.config import LOAD_FORMATS, ModelSpec, load_model_spec, normalize_dtype
from hybrid_cache.engine.generation_config import check_generation_config
from hybrid_cache.engine.tokenizer import TOKENIZER_FILES, has_tokenizer_files
from hybrid_cache.errors import ConfigError, EngineConfigError, MemorySizeError, PlanError
from hybrid_cache.planner import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GROUP_LAYOUTS,
    PLAN_MODES,
    PlanOptions,
)
from hybrid_cache.sizes import MemorySize, format_memory_size, parse_memory_size

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The KV budget on the CPU when none is given (`memory.py`): enough for the small models the CPU
# runs, and cheap to zero.
DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 1024**2
# Admission order of waiting requests (see `scheduler.py`): first come first served, or the
# longest cached prefix first (the default: it keeps the histories a wave of conversation turns
# would hit; requests with nothing cached still go in arrival order; BENCHMARKS.md).
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "lpm")
# `admission_headroom`: "auto" = on for pools with windowed groups (`scheduler.py`).
ADMISSION_HEADROOM_CHOICES: tuple[str, ...] = ("auto", "on", "off")
DEFAULT_SCHEDULING_POLICY = "lpm"
# `--kv-cache-mode both` (plan, bench) runs each mode; a config holds one.
BOTH_MODES = "both"
# Seconds a tensor-parallel collective (the step broadcast, an all-reduce) may wait for a rank
# before the engine ends with `WorkerFailedError` naming it (`engine/parallel/`).
DEFAULT_DISTRIBUTED_TIMEOUT_S = 300.0
# Share of the KV blocks freed prefix chains may hold protected (`docs/DESIGN.md`, "Protected
# chains"; measured in BENCHMARKS.md).
DEFAULT_PROTECTED_PREFIX_FRACTION = 0.75


@dataclass(frozen=True)
class SchedulerLimits:
    """What the scheduler and the coordinator are sized by."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY
    hold_waiting_prefixes: bool = True
    admission_headroom: str = "auto"
    tail_replay: bool = True
    token_tails: bool = True
    protected_prefix_fraction: float = DEFAULT_PROTECTED_PREFIX_FRACTION


@dataclass(frozen=True)
class EngineConfig:
    """The model, the KV-cache plan options, the scheduler limits and the runtime options of one
    engine. `model`: a Hugging Face folder or a preset name; `max_model_len` None = the model's
    `max_position_embeddings`; `kv_cache_memory` (bytes after validation) None = profiled on
    CUDA (`gpu_memory_utilization` of the device), 512 MiB on the CPU; `dtype` "auto" = float32
    on the CPU, the config's elsewhere; `device` None = CUDA when available;
    `kv_group_layout`: the planner's `group_layout`; `attention_backend`: "auto" or a backend
    name (checked by the selector, which knows the registered backends); `scheduling_policy`:
    "lpm" (longest cached prefix first, the default) or "fcfs" (`scheduler.py`);
    `hold_waiting_prefixes`: a request takes its prefix-cache
    hit when it arrives, so admissions before it cannot evict it (`scheduler.py`);
    `admission_headroom`: "on" = while requests run and waiting requests hold hits, an admission
    leaves free the blocks the running requests take at their next token, so their growth does
    not preempt it at once; "auto" (the default) = on for pools with windowed groups, where
    such a preemption loses the newcomer's whole hit; "off" (`scheduler.py`);
    `tail_replay`: a prefix hit whose windowed blocks were evicted keeps its full-attention
    blocks and recomputes only the windows (docs/DESIGN.md, "Tail replay");
    `token_tails`: a finished request's last, partly filled block stays cached under a key of
    exactly its tokens, so the next turn of a conversation hits every token the previous turn
    computed, not only whole blocks (docs/DESIGN.md, "Token tails");
    `protected_prefix_fraction`: the share of the KV blocks that finished requests' cached
    prefixes may hold in a free tier evicted last, so conversations served round-robin beyond
    what the cache holds keep hitting (0: plain LRU; docs/DESIGN.md, "Protected chains");
    `generation_config`: "auto" (the model folder's `generation_config.json`: EOS ids and
    default sampling values), "vllm" (the engine's sampling defaults) or a folder to read it
    from (`generation_config.py`); `tokenizer`: a tokenizer folder instead of the model
    folder's (a preset then takes text prompts); `enforce_eager`: run every step eagerly
    (by default pure-decode steps on CUDA replay CUDA graphs, `engine/decode_graphs.py`);
    `tensor_parallel_size`: ranks the model is sharded over (worker
    processes joined by torch.distributed, `engine/parallel/`), `distributed_timeout`: seconds
    a collective waits for a rank before the engine fails naming it, `vocab_parallel`: the
    embedding and the LM head split by vocabulary over the ranks (False: replicated on each)."""

    model: str
    # The model.
    load_format: str = "auto"
    hf_overrides: Optional[Mapping[str, Any]] = None
    generation_config: str = "auto"
    tokenizer: Optional[str] = None
    # The KV-cache plan.
    kv_cache_memory: Optional[MemorySize] = None
    max_model_len: Optional[int] = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_mode: str = "hybrid"
    kv_group_layout: str = "auto"
    # The scheduler.
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY
    hold_waiting_prefixes: bool = True
    admission_headroom: str = "auto"
    tail_replay: bool = True
    token_tails: bool = True
    protected_prefix_fraction: float = DEFAULT_PROTECTED_PREFIX_FRACTION
    # The runtime.
    dtype: Union[str, torch.dtype] = "auto"
    device: Union[str, torch.device, None] = None
    seed: int = 0
    attention_backend: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False
    # Tensor parallelism.
    tensor_parallel_size: int = 1
    distributed_timeout: float = DEFAULT_DISTRIBUTED_TIMEOUT_S
    vocab_parallel: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise EngineConfigError(
                f"--model must be a model folder or a preset name, got {self.model!r}"
                f"{_hint('model')}"
            )
        object.__setattr__(self, "model", os.fspath(self.model))
        check_choice(
            self.load_format, LOAD_FORMATS, "--load-format", EngineConfigError, _hint("load_format")
        )
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, Mapping):
            raise ConfigError(
                f"--hf-overrides must be a JSON object (a dict), got "
                f"{type(self.hf_overrides).__name__}{_hint('hf_overrides')}"
            )
        object.__setattr__(self, "hf_overrides", dict(self.hf_overrides or {}) or None)
        object.__setattr__(
            self,
            "generation_config",
            check_generation_config(self.generation_config, _hint("generation_config")),
        )
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)):
                raise EngineConfigError(
                    f"--tokenizer must be a folder, got {self.tokenizer!r}{_hint('tokenizer')}"
                )
            object.__setattr__(self, "tokenizer", os.fspath(self.tokenizer))
            if not has_tokenizer_files(self.tokenizer):
                raise EngineConfigError(
                    f"--tokenizer {self.tokenizer} is not a folder with tokenizer files "
                    f"({', '.join(TOKENIZER_FILES)}): give a local tokenizer folder, or leave it "
                    f"out to use the model folder's{_hint('tokenizer')}"
                )
        if self.kv_cache_memory is not None:
            try:
                memory = parse_memory_size(self.kv_cache_memory)
            except MemorySizeError as error:
                raise MemorySizeError(
                    f"--kv-cache-memory: {error}{_hint('kv_cache_memory')}"
                ) from error
            object.__setattr__(self, "kv_cache_memory", memory)
        if self.max_model_len is not None:
            check_positive_int(
                self.max_model_len, "--max-model-len", PlanError, _hint("max_model_len")
            )
        check_block_size(self.block_size, "--block-size", _hint("block_size"))
        check_choice(
            self.kv_cache_mode, PLAN_MODES, "--kv-cache-mode", PlanError, _hint("kv_cache_mode")
        )
        check_choice(
            self.kv_group_layout,
            GROUP_LAYOUTS,
            "--kv-group-layout",
            PlanError,
            _hint("kv_group_layout"),
        )
        check_positive_int(
            self.max_num_seqs, "--max-num-seqs", EngineConfigError, _hint("max_num_seqs")
        )
        check_positive_int(
            self.max_num_batched_tokens,
            "--max-num-batched-tokens",
            PlanError,
            _hint("max_num_batched_tokens"),
        )
        check_bool(
            self.enable_prefix_caching,
            "--enable-prefix-caching",
            EngineConfigError,
            _hint("enable_prefix_caching"),
        )
        check_choice(
            self.scheduling_policy,
            SCHEDULING_POLICIES,
            "--scheduling-policy",
            EngineConfigError,
            _hint("scheduling_policy"),
        )
        check_bool(
            self.hold_waiting_prefixes,
            "--hold-waiting-prefixes",
            EngineConfigError,
            _hint("hold_waiting_prefixes"),
        )
        check_choice(
            self.admission_headroom,
            ADMISSION_HEADROOM_CHOICES,
            "--admission-headroom",
            EngineConfigError,
            _hint("admission_headroom"),
        )
        check_bool(self.tail_replay, "--tail-replay", EngineConfigError, _hint("tail_replay"))
        check_bool(self.token_tails, "--token-tails", EngineConfigError, _hint("token_tails"))
        fraction = self.protected_prefix_fraction
        if not is_real(fraction) or not 0.0 <= fraction <= 1.0:
            raise EngineConfigError(
                f"--protected-prefix-fraction must be a number from 0 to 1 (0: plain LRU "
                f"eviction), got {fraction!r}" + _hint("protected_prefix_fraction")
            )
        check_bool(
            self.enforce_eager,
            "--enforce-eager: enforce_eager",
            EngineConfigError,
            _hint("enforce_eager"),
        )
        if self.dtype is None:
            object.__setattr__(self, "dtype", "auto")
        if isinstance(self.dtype, str) and self.dtype != "auto":
            try:
                normalize_dtype(self.dtype)
            except ConfigError as error:
                raise ConfigError(f"--dtype: {error}{_hint('dtype')}") from error
        if not is_int(self.seed):
            raise EngineConfigError(f"--seed must be an integer, got {self.seed!r}{_hint('seed')}")
        if not isinstance(self.attention_backend, str):
            raise EngineConfigError(
                f"--attention-backend must be a backend name or 'auto', got "
                f"{self.attention_backend!r}{_hint('attention_backend')}"
            )
        utilization = self.gpu_memory_utilization
        if not is_real(utilization) or not (0.0 < utilization <= 1.0):
            raise EngineConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}"
                f"{_hint('gpu_memory_utilization')}"
            )
        check_positive_int(
            self.tensor_parallel_size,
            "--tensor-parallel-size",
            EngineConfigError,
            _hint("tensor_parallel_size"),
        )
        timeout = self.distributed_timeout
        if not is_real(timeout) or not timeout > 0:
            raise EngineConfigError(
                f"--distributed-timeout must be a positive number of seconds, got {timeout!r}"
                f"{_hint('distributed_timeout')}"
            )
        check_bool(
            self.vocab_parallel, "--vocab-parallel", EngineConfigError, _hint("vocab_parallel")
        )

    @classmethod
    def of(cls, model: Union[str, os.PathLike, EngineConfig], **kwargs: Any) -> EngineConfig:
        """`LLM(model, **kwargs)`'s config: `model` with the keyword arguments, or a config with
        some fields replaced. An unknown keyword is an `EngineConfigError` listing the known."""
        unknown = sorted(set(kwargs) - ENGINE_FIELDS)
        if unknown:
            raise EngineConfigError(
                f"unknown engine argument(s) {', '.join(unknown)}; the arguments are "
                f"{', '.join(sorted(ENGINE_FIELDS))}"
            )
        if isinstance(model, EngineConfig):
            return dataclasses.replace(model, **kwargs) if kwargs else model
        return cls(model, **kwargs)

    def model_spec(self) -> ModelSpec:
        """The model's `ModelSpec` (its config with `hf_overrides` merged)."""
        return load_model_spec(self.model, self.hf_overrides)

    @property
    def tokenizer_source(self) -> str:
        """Where the tokenizer is read from: `tokenizer`, else the model folder (a preset has
        no tokenizer files, so none)."""
        return self.tokenizer or self.model

    def resolved_max_model_len(self, spec: ModelSpec) -> int:
        return self.max_model_len or spec.max_position_embeddings

    def plan_options(
        self, kv_cache_memory: MemorySize, max_model_len: int, **extra: Any
    ) -> PlanOptions:
        """The planner's options for a budget and a context length; `extra`: the options an
        engine does not set (`kv_cache_dtype`, `max_padding_waste`, `strict_windows`)."""
        return PlanOptions(
            kv_cache_memory=kv_cache_memory,
            max_model_len=max_model_len,
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            group_layout=self.kv_group_layout,
            **extra,
        )

    def scheduler_limits(self, max_model_len: int) -> SchedulerLimits:
        return SchedulerLimits(
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy,
            hold_waiting_prefixes=self.hold_waiting_prefixes,
            admission_headroom=self.admission_headroom,
            tail_replay=self.tail_replay,
            token_tails=self.token_tails,
            protected_prefix_fraction=float(self.protected_prefix_fraction),
        )


ENGINE_FIELDS: frozenset[str] = frozenset(field.name for field in dataclasses.fields(EngineConfig))
# The fields `add_engine_arguments(parser, plan_only=True)` adds flags for.
PLAN_FIELDS: tuple[str, ...] = (
    "model",
    "hf_overrides",
    "kv_cache_memory",
    "max_model_len",
    "block_size",
    "kv_cache_mode",
    "kv_group_layout",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "vocab_parallel",
)


def _hint(name: str) -> str:
    return f" (LLM argument {name})"


# ---------------------------------------------------------------------------------------------
# Command-line flags.


def parse_hf_overrides(text: Optional[str]) -> Optional[dict[str, Any]]:
    """`--hf-overrides` (a JSON object) as a dict; None when not given. `ConfigError` otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"--hf-overrides must be a JSON object like '{{\"sliding_window\": 512}}', got "
            f"{text!r} ({error})"
        ) from error
    if not isinstance(value, dict):
        raise ConfigError(
            f"--hf-overrides must be a JSON object like '{{\"sliding_window\": 512}}', got a "
            f"{type(value).__name__}"
        )
    return value


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    plan_only: bool = False,
    both_modes: bool = False,
    help_texts: Optional[Mapping[str, str]] = None,
    **defaults: Any,
) -> None:
    """The flags of `EngineConfig`'s fields (`--model`, `--block-size`, ...), each defaulting to
    the field's default. `plan_only`: only the model and plan options (`PLAN_FIELDS`);
    `both_modes`: `--kv-cache-mode` also takes "both" (the command runs each mode); `help_texts`:
    per field, the command's own help text; `defaults`: per field, the command's own default
    (`required=True` for `kv_cache_memory` makes that flag required)."""
    texts = dict(help_texts or {})
    fields = {field.name: field for field in dataclasses.fields(EngineConfig)}

    def add(name: str, *flags: str, **kwargs: Any) -> None:
        if plan_only and name not in PLAN_FIELDS:
            return
        if name in defaults:
            value = defaults[name]
            # A command's own default makes the flag optional (`serve` takes MODEL positionally).
            kwargs.update(
                {"required": True} if value is _REQUIRED else {"default": value, "required": False}
            )
        elif "default" not in kwargs and "action" not in kwargs:
            default = fields[name].default
            kwargs["default"] = None if default is dataclasses.MISSING else default
        kwargs["help"] = texts.get(name, kwargs.get("help"))
        parser.add_argument(*(flags or ("--" + name.replace("_", "-"),)), dest=name, **kwargs)

    add("model", required=True, help="model folder with config.json, or preset")
    add("hf_overrides", help="JSON object deep-merged into config.json (default: none)")
    add("load_format", choices=LOAD_FORMATS, help="dummy: seeded random weights")
    add(
        "generation_config",
        help="auto: the model folder's generation_config.json gives EOS ids and default "
        "sampling values; vllm: the engine's sampling defaults; or a folder to read it from",
    )
    add(
        "tokenizer",
        help="a tokenizer folder (default: the model folder's tokenizer; a preset has none)",
    )
    add(
        "kv_cache_memory",
        help="KV budget: bytes or e.g. 512MiB, 40GB (default: profiled on CUDA, see "
        f"--gpu-memory-utilization; {format_memory_size(DEFAULT_CPU_KV_CACHE_MEMORY)} on the CPU)",
    )
    add("max_model_len", type=int, help="context length (default: max_position_embeddings)")
    add("block_size", type=int, help="tokens per block of the largest page (a power of two)")
    add(
        "kv_cache_mode",
        choices=PLAN_MODES + ((BOTH_MODES,) if both_modes else ()),
        help="hybrid (per-type groups) or uniform (every layer full attention)",
    )
    add(
        "kv_group_layout",
        choices=GROUP_LAYOUTS,
        help="KV-cache groups: equal-size ('equal'), one per layer type ('per-type'), or 'auto' "
        "(per type where that makes fewer groups with little page padding, unless the pool holds "
        "few requests and the coarser blocks would cost prefix hits; docs/PLANNER.md)",
    )
    add("max_num_seqs", type=int, help="most requests in one step")
    add("max_num_batched_tokens", type=int, help="most tokens in one step (the prefill chunk)")
    add(
        "enable_prefix_caching",
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.get("enable_prefix_caching", True),
        help="reuse cached KV blocks of shared prefixes",
    )
    add(
        "scheduling_policy",
        help="admission order of waiting requests: lpm (longest cached prefix first, arrival "
        "order among equal hits, at most 64 overtakes; running requests that cannot grow "
        "preempt newer ones before a waiting request's held hit is released) or fcfs (first "
        "come first served, as vLLM's default; scheduler.py)",
    )
    add(
        "hold_waiting_prefixes",
        "--hold-waiting-prefixes",
        action=argparse.BooleanOptionalAction,
        default=defaults.get("hold_waiting_prefixes", True),
        help="a request takes its prefix-cache hit on arrival, so admissions before it cannot "
        "evict it (released, newest first, when running requests need the blocks)",
    )
    add(
        "admission_headroom",
        help="auto|on|off: while requests run and waiting requests hold hits, an admission leaves "
        "free the blocks the running requests take at their next token, so their growth does "
        "not preempt it at once (auto: on for models with sliding-window layers)",
    )
    add(
        "tail_replay",
        "--tail-replay",
        action=argparse.BooleanOptionalAction,
        default=defaults.get("tail_replay", True),
        help="when a prefix hit's windowed blocks were evicted, keep its full-attention blocks "
        "and recompute only the tokens the windows need (exact; taken when it saves tokens)",
    )
    add(
        "token_tails",
        "--token-tails",
        action=argparse.BooleanOptionalAction,
        default=defaults.get("token_tails", True),
        help="keep a finished request's last, partly filled block cached, so the next turn of "
        "a conversation hits every computed token instead of whole blocks only",
    )
    add(
        "protected_prefix_fraction",
        "--protected-prefix-fraction",
        type=float,
        help="share of the KV blocks finished requests' cached prefixes may hold in a free tier "
        "evicted last, so conversations served round-robin beyond what the cache holds keep "
        "hitting (0: plain LRU)",
    )
    if not plan_only:
        parser.add_argument(
            "--no-prefix-caching",
            dest="enable_prefix_caching",
            action="store_false",
            help="the same as --no-enable-prefix-caching",
        )
    add("dtype", help="model dtype: auto (float32 on the CPU, the config's on CUDA) or a name")
    add("device", help="cpu, cuda, cuda:1, ... (default: CUDA when available)")
    add("seed", type=int, help="seed of the dummy weights, the sampler and the prefix hashes")
    add("attention_backend", help="auto, or torch / reference / triton / flash_attn")
    add("gpu_memory_utilization", type=float, help="share of GPU memory the engine may use")
    add(
        "enforce_eager",
        "--enforce-eager",
        action="store_true",
        default=defaults.get("enforce_eager", False),
        help="run every step eagerly (default: pure-decode steps on CUDA replay CUDA graphs)",
    )
    add(
        "tensor_parallel_size",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="ranks (processes; GPUs on CUDA) the model is sharded over; plan: the KV bytes "
        "and concurrency of one rank",
    )
    add(
        "distributed_timeout",
        type=float,
        help="seconds a tensor-parallel collective waits for a rank before the engine fails "
        "naming it",
    )
    add(
        "vocab_parallel",
        "--vocab-parallel",
        action=argparse.BooleanOptionalAction,
        default=defaults.get("vocab_parallel", True),
        help="under tensor parallelism, split the embedding and the LM head by vocabulary over "
        "the ranks (--no-vocab-parallel: a full copy on every rank)",
    )


_REQUIRED = object()
REQUIRED = _REQUIRED  # `add_engine_arguments(parser, kv_cache_memory=REQUIRED)`


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The `EngineConfig` of flags added by `add_engine_arguments`, with `overrides` (e.g. one
    budget of a sweep, or one mode of `--kv-cache-mode both`, which alone means "hybrid")."""
    values = {name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)}
    values["hf_overrides"] = parse_hf_overrides(values.get("hf_overrides"))
    if values.get("kv_cache_mode") == BOTH_MODES:
        values["kv_cache_mode"] = "hybrid"
    values.update(overrides)
    return EngineConfig(**values)


def modes_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The modes `--kv-cache-mode` asks for ("both" = hybrid, then uniform)."""
    return PLAN_MODES if args.kv_cache_mode == BOTH_MODES else (args.kv_cache_mode,)
