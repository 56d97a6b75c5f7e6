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

- `vocab_embedding` / `lm_head` (vocabulary-parallel, the default): the vocabulary, padded to a
  multiple of N (`padded_vocab_size`), split into N row ranges; the embedding looks up the ids
  in the rank's range (zero elsewhere) and all-reduces; the LM head computes the rank's logit
  columns and gathers them to rank 0, which drops the padding columns (so a padded id can never
  be sampled); the other ranks' `lm_head(...)` returns None. A tied head shares the embedding's
  shard. Padded rows are zeros, not read from the checkpoint. With `TensorShard.shard_vocab`
  False both are replicated (an `nn.Embedding`, an `nn.Linear`) and only rank 0 calls the head.

`all_reduce` sums in place over the group `set_collectives` registered (the engine's worker
processes, `engine/parallel/`), `gather_to_driver` collects a tensor on rank 0; both count, per
rank, the collectives it entered (a shared counter the driver reads to tell which rank hung).
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
    """Rank `rank` of `size` tensor-parallel ranks (0 of 1: no parallelism); `shard_vocab`:
    the embedding and the LM head split by vocabulary rows (else replicated)."""

    rank: int = 0
    size: int = 1
    shard_vocab: bool = True

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

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """This rank's [start, stop) of the padded vocabulary (`padded_vocab_size`)."""
        per_rank = padded_vocab_size(vocab_size, self.size) // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank


def padded_vocab_size(vocab_size: int, size: int) -> int:
    """The vocabulary rounded up to a multiple of `size` ranks (vLLM pads it too)."""
    return -(-vocab_size // size) * size


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
    full shape (in the parameter's orientation) is `full_shape`. A `stop` past the tensor's
    length (the padded vocabulary's last rows) is padding: zeros, not in the checkpoint."""

    dim: int
    start: int
    stop: int
    full_shape: tuple[int, ...]

    def index(self) -> tuple[slice, ...]:
        """The slice of the full tensor (for `tensor[...]` or a safetensors slice), padding
        excluded."""
        length = self.full_shape[self.dim]
        start, stop = min(self.start, length), min(self.stop, length)
        return (slice(None),) * self.dim + (slice(start, stop),)

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (read by `index()`) with the padding rows appended as zeros."""
        missing = (self.stop - self.start) - values.shape[self.dim]
        if missing == 0:
            return values
        shape = list(values.shape)
        shape[self.dim] = missing
        zeros = torch.zeros(shape, dtype=values.dtype, device=values.device)
        return torch.cat([values, zeros], dim=self.dim)


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


class VocabParallelEmbedding(nn.Module):
    """The embedding rows `rows` of the padded vocabulary: ids outside them embed as zeros,
    and the all-reduce sums the one rank's row that is not."""

    def __init__(self, vocab_size: int, hidden_size: int, rows: tuple[int, int]) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(rows[1] - rows[0], hidden_size))
        declare_sharded(self, "weight", 0, rows, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.rows
        outside = (input_ids < start) | (input_ids >= stop)
        local = (input_ids - start).masked_fill_(outside, 0)
        hidden = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(hidden)


class VocabParallelLMHead(nn.Module):
    """The LM head's rows `rows` of the padded vocabulary: each rank computes its logit
    columns, rank 0 gathers them (`gather_to_driver`) and returns the `vocab_size` real ones;
    the other ranks return None."""

    def __init__(self, vocab_size: int, hidden_size: int, rows: tuple[int, int]) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(rows[1] - rows[0], hidden_size))
        declare_sharded(self, "weight", 0, rows, vocab_size)

    def forward(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        shards = gather_to_driver(F.linear(hidden, self.weight))
        if shards is None:
            return None
        return torch.cat(shards, dim=-1)[..., : self.vocab_size]


def vocab_embedding(vocab_size: int, hidden_size: int) -> nn.Module:
    """The input embedding: `nn.Embedding` at N = 1 (or replicated), else the rank's rows."""
    shard = current_shard()
    if shard.size == 1 or not shard.shard_vocab:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, shard.vocab_rows(vocab_size))


def lm_head(hidden_size: int, vocab_size: int) -> nn.Module:
    """The LM head: `nn.Linear` at N = 1 (or replicated), else the rank's vocabulary rows."""
    shard = current_shard()
    if shard.size == 1 or not shard.shard_vocab:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return VocabParallelLMHead(vocab_size, hidden_size, shard.vocab_rows(vocab_size))


def is_vocab_parallel(model: nn.Module) -> bool:
    """Whether `model`'s LM head is split by vocabulary (every rank must call it)."""
    return isinstance(model.lm_head, VocabParallelLMHead)


# ---------------------------------------------------------------------------------------------
# The collectives.


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


def gather_to_driver(tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """Every rank's `tensor` (the same shape on each), in rank order, on rank 0; None on the
    other ranks. A gather, not an all-gather: only rank 0 samples, so the others need none of
    it, and each shard crosses the wire once instead of N - 1 times."""
    count_collective()
    group = _COLLECTIVES.group
    tensor = tensor.contiguous()
    if _COLLECTIVES.rank != 0:
        torch.distributed.gather(tensor, None, dst=0, group=group)
        return None
    size = torch.distributed.get_world_size(group)
    shards = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.gather(tensor, shards, dst=0, group=group)
    return shards
