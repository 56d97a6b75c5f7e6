"""Tensor-parallel building blocks: which rank a model is built for, the sharded linear layers,
and the one collective the forward needs (an all-reduce over the ranks).

A model is built for one `TensorShard` (rank r of N; `build_model` sets it with
`building_shard`, the layers read it with `current_shard`). Sharded modules keep transformers'
parameter names and hold only their rank's slice; `shard_rules` says, per parameter, which rows
or columns of the checkpoint tensor that is (`ShardRule`), so the loader reads only that slice
(`safe_open(...).get_slice`) and dummy weights are the TP=1 weights, sliced.

- `column_parallel_linear` (q/k/v, gate/up): the output features split, no communication;
- `row_parallel_linear` (o, down): the input features split, the partial products summed by an
  all-reduce, the bias added once after it;
- at N = 1 both return a plain `nn.Linear`, so a single-device model is unchanged.

The embedding and the LM head are replicated: every rank embeds the full vocabulary and only
rank 0, which samples, computes logits.

`all_reduce` sums in place over the group `set_collectives` registered (the engine's worker
processes, `engine/parallel/`) and counts, per rank, the collectives it entered (a shared
counter the driver reads to tell which rank hung).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybrid_cache.config import per_rank_kv_heads


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size` tensor-parallel ranks (0 of 1: no parallelism)."""

    rank: int = 0
    size: int = 1

    def split(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` items split evenly."""
        assert total % self.size == 0, f"{total} does not split over {self.size} ranks"
        per_rank = total // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's [start, stop) of the KV heads: an even split, or the one head the rank
        shares with `size / num_kv_heads - 1` others when there are fewer heads than ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        head = self.rank // (self.size // num_kv_heads)
        assert per_rank_kv_heads(num_kv_heads, self.size) == 1
        return head, head + 1


NO_SHARD = TensorShard()
_BUILDING: ContextVar[TensorShard] = ContextVar("hybrid_cache_building_shard", default=NO_SHARD)


@contextmanager
def building_shard(shard: TensorShard) -> Iterator[None]:
    """Modules constructed inside take `shard` as `current_shard()`."""
    token = _BUILDING.set(shard)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def current_shard() -> TensorShard:
    """The shard the model under construction is built for."""
    return _BUILDING.get()


@dataclass(frozen=True)
class ShardRule:
    """A parameter holds `[start, stop)` of dimension `dim` of the checkpoint tensor, whose
    full shape (in the parameter's orientation) is `full_shape`."""

    dim: int
    start: int
    stop: int
    full_shape: tuple[int, ...]

    def index(self) -> tuple[slice, ...]:
        """The slice of the full tensor (for `tensor[...]` or a safetensors slice)."""
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


def shard_rule(model: nn.Module, name: str) -> Optional[ShardRule]:
    """The `ShardRule` of parameter `name` (a path in `model`), None when it is replicated."""
    owner, _, leaf = name.rpartition(".")
    rules = getattr(model.get_submodule(owner), "shard_rules", None)
    return None if rules is None else rules.get(leaf)


def declare_sharded(
    module: nn.Module, name: str, dim: int, span: tuple[int, int], full_length: int
) -> None:
    """Records that `module.<name>` holds `span` of dimension `dim` (of length `full_length`
    in the checkpoint)."""
    full_shape = list(getattr(module, name).shape)
    full_shape[dim] = full_length
    rules = module.__dict__.setdefault("shard_rules", {})
    rules[name] = ShardRule(dim, span[0], span[1], tuple(full_shape))


class ColumnParallelLinear(nn.Linear):
    """`nn.Linear` holding the output features `rows` = [start, stop) of an `out_features`
    layer (weight rows, bias entries); no communication."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, rows: tuple[int, int]
    ) -> None:
        super().__init__(in_features, rows[1] - rows[0], bias=bias)
        declare_sharded(self, "weight", 0, rows, out_features)
        if bias:
            declare_sharded(self, "bias", 0, rows, out_features)


class RowParallelLinear(nn.Module):
    """A linear layer holding the input features `columns` of an `in_features` layer: its
    partial product is summed over the ranks (`all_reduce`), then the full bias is added."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, columns: tuple[int, int]
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, columns[1] - columns[0]))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        declare_sharded(self, "weight", 1, columns, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def column_parallel_linear(
    in_features: int, out_features: int, bias: bool, rows: Optional[tuple[int, int]] = None
) -> nn.Linear:
    """q/k/v, gate/up: `nn.Linear` at N = 1, else the rank's `rows` (default: an even split)."""
    shard = current_shard()
    if shard.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    rows = shard.split(out_features) if rows is None else rows
    return ColumnParallelLinear(in_features, out_features, bias, rows)


def row_parallel_linear(
    in_features: int, out_features: int, bias: bool, columns: Optional[tuple[int, int]] = None
) -> nn.Module:
    """o, down: `nn.Linear` at N = 1, else the rank's `columns` (default: an even split)."""
    shard = current_shard()
    if shard.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    columns = shard.split(in_features) if columns is None else columns
    return RowParallelLinear(in_features, out_features, bias, columns)


# ---------------------------------------------------------------------------------------------
# The collective.


@dataclass
class _Collectives:
    group: Any = None  # a torch.distributed process group; None = the default group
    rank: int = 0
    entered: Optional[np.ndarray] = None  # per rank: collectives entered (shared memory)


_COLLECTIVES = _Collectives()


def set_collectives(group: Any, rank: int, entered: Optional[np.ndarray]) -> None:
    """Registers the group `all_reduce` sums over (the engine's worker processes) and the
    shared per-rank counter of collectives entered (None: not counted)."""
    _COLLECTIVES.group, _COLLECTIVES.rank, _COLLECTIVES.entered = group, rank, entered


def count_collective() -> None:
    """Marks that this rank entered one more collective (read by the driver on a timeout)."""
    entered = _COLLECTIVES.entered
    if entered is not None:
        entered[_COLLECTIVES.rank] += 1


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sums `tensor` over the tensor-parallel ranks, in place; returns it."""
    count_collective()
    torch.distributed.all_reduce(tensor, group=_COLLECTIVES.group)
    return tensor
