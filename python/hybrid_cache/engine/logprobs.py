"""Logprobs: the chosen token's and the top-k of each row of raw logits, and their output form.

Rows are kept compact while a request runs (`TokenLogprobs`: the ids and logprobs of the chosen
token and then the top k, and the chosen token's rank) and turned into vLLM's form, one dict
token id -> `Logprob(logprob, rank, decoded_token)` per position, when the request's output is
built. A batch's rows stay arrays until first read (`LogprobRows`), then come from one
`.tolist()` per array, with no per-row Python when every row asks for the same k; on the CPU
its top k comes from the native top k (`rust/sampling`) where that is exact (`top_k`). The
engine's steps' rows wait in a `LogprobLog` by request id, so a step touches no request to
record them: a request takes its rows out when its logprobs are read, and keeps the records
holding the others when it finishes.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

import numpy as np
import torch

from hybrid_cache._core import (
    greedy_logprob_top_k_rows_cpu,
    log_softmax_rows_cpu,
    logprob_top_k_rows_cpu,
    top_k_rows_cpu,
)
from hybrid_cache.engine.outputs import Logprob

# One position: the ids and logprobs of the chosen token and then the top k (most likely
# first, ranks 1..k), and the chosen token's rank, or None when the chosen token is more
# likely than the k-th: then only top k tokens can be at least as likely (`chosen_rank`).
TokenLogprobs = tuple[list[int], list[float], Optional[int]]


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | np.ndarray, num_logprobs: Sequence[int]
) -> LogprobRows:
    """Per row of `logits` [rows, vocab]: the logprob and rank of `token_ids[row]` and the
    `num_logprobs[row]` most likely tokens, from the log-softmax of the logits as given
    (rank 1 = most likely; the chosen token's rank counts the tokens at least as likely).
    On the CPU the log-softmax is the native one, taken with the top k from the logits
    (`logprob_top_k`); elsewhere torch's."""
    logits = logits.float()
    k = min(max(num_logprobs, default=0), logits.shape[-1])
    if logits.device.type == "cpu":
        ids, values, ranks = logprob_top_k(logits, k, np.asarray(token_ids))
        return LogprobRows(ids, values, ranks, num_logprobs, k)
    logprobs = logits.log_softmax(dim=-1)
    assert isinstance(token_ids, torch.Tensor), "on a device the sampled ids are a tensor"
    chosen_ids = token_ids.to(logprobs.device).view(-1, 1)
    ids, values = chosen_ids, logprobs.gather(1, chosen_ids)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        ids, values = torch.cat([ids, top_ids], 1), torch.cat([values, top_values], 1)
    chosen = values[:, :1]
    ranks = None  # `chosen_rank` counts over the top k
    if not (k and bool((chosen > values[:, k:]).all())):
        ranks = (logprobs >= chosen).sum(-1)
    return LogprobRows(ids, values, ranks, num_logprobs, k)


def greedy_token_logprobs(
    logits: torch.Tensor, num_logprobs: Sequence[int], k: Optional[int] = None
) -> tuple[np.ndarray, LogprobRows]:
    """The greedy token of each row of CPU `logits` [rows, vocab] (numpy's argmax pick, as
    `greedy_tokens`: the first maximum, or the first NaN) as int64, and `token_logprobs` of
    the rows for it, from one native pass over each row: the pick comes from the top k's scan
    (`_core.greedy_logprob_top_k_rows_cpu`), with no argmax pass of its own. The rows that
    pass does not settle (a tie for the maximum or among the top k + 1, NaN, infinities) take
    numpy's argmax and `logprob_top_k`. `k`: `max(num_logprobs)` when the caller knows it.

    Called once per decode step with the CPU caches cold (the forward evicted them), so it
    makes few calls: no conversion of float32 logits, no copy of contiguous ones."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if not logits.is_contiguous():
        logits = logits.contiguous()
    array = logits.numpy()
    num_rows, vocab_size = array.shape
    k = min(max(num_logprobs, default=0) if k is None else k, vocab_size)
    if k >= vocab_size:
        chosen = array.argmax(axis=-1).astype(np.int64, copy=False)
        return chosen, token_logprobs(logits, chosen, num_logprobs)
    ids = np.empty((num_rows, k + 1), dtype=np.int64)
    values = np.empty((num_rows, k + 1), dtype=np.float32)
    ranks = np.empty(num_rows, dtype=np.int64)
    others = greedy_logprob_top_k_rows_cpu(array, k, ids, values, ranks)
    if others:
        rows = array[others]
        chosen = rows.argmax(axis=-1).astype(np.int64, copy=False)
        ids[others], values[others], ranks[others] = logprob_top_k(
            torch.from_numpy(rows), k, chosen
        )
    return ids[:, 0].copy(), LogprobRows(ids, values, ranks, num_logprobs, k)


class LogprobLog:
    """The steps' `LogprobRows`, in the order recorded, each with a map from its rows' request
    ids to their rows. A request that asks for logprobs opens a cursor (the number of records
    when it was queued) and takes, from the records since, the rows under its id, moving its
    cursor past them; when it finishes it closes its cursor and keeps the records since (a
    slice: no row read, no per-record work). The log forgets the records below every open
    cursor, so it holds nothing for requests that are gone; a finished request's records live
    as long as it does."""

    def __init__(self) -> None:
        self.records: list[LogprobRecord] = []
        self.base: int = 0  # the number of `records[0]`
        self.cursors: collections.Counter[int] = collections.Counter()  # open: how many at each
        self.low: int = 0  # the lowest open cursor (`num_records` when none is open)

    @property
    def num_records(self) -> int:
        return self.base + len(self.records)

    def record(self, rows: LogprobRows, request_ids: Sequence[str]) -> None:
        """Keeps `rows`, row i being `request_ids[i]`'s."""
        self.records.append((rows, RowIndex(request_ids)))

    def open(self) -> int:
        """A new reader's cursor: the records from now on."""
        cursor = self.num_records
        if not self.cursors:
            self.low = cursor
        self.cursors[cursor] += 1
        return cursor

    def take(self, request_id: str, cursor: int) -> tuple[list[TokenLogprobs], int]:
        """`request_id`'s rows in the records from `cursor` (its open cursor) on, in order,
        and its cursor moved past them."""
        taken = take_rows(self.records[cursor - self.base :], request_id)
        end = self.num_records
        self.cursors[end] += 1
        self._close(cursor)
        return taken, end

    def close(self, cursor: int) -> list[LogprobRecord]:
        """Closes a reader's cursor; returns the records from it on (the reader's rows are in
        them, under its id)."""
        span = self.records[cursor - self.base :]
        self._close(cursor)
        return span

    def _close(self, cursor: int) -> None:
        cursors = self.cursors
        cursors[cursor] -= 1
        if cursors[cursor]:
            return
        del cursors[cursor]
        if cursor != self.low:
            return
        self.low = min(cursors, default=self.num_records)
        del self.records[: self.low - self.base]
        self.base = self.low


class RowIndex:
    """A step's request ids, row i being `request_ids[i]`'s; the map id -> row is made on the
    first lookup (when a request reads its rows, out of the step's time)."""

    __slots__ = ("request_ids", "_rows")

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = request_ids
        self._rows: Optional[dict[str, int]] = None

    def get(self, request_id: str) -> Optional[int]:
        """The row of `request_id`, or None when the step has none."""
        rows = self._rows
        if rows is None:
            ids = self.request_ids
            rows = self._rows = dict(zip(ids, range(len(ids))))
        return rows.get(request_id)


# A step's rows and the index of each request's row there.
LogprobRecord = tuple["LogprobRows", RowIndex]


def take_rows(records: Iterable[LogprobRecord], request_id: str) -> list[TokenLogprobs]:
    """`request_id`'s rows in `records`, in order, taken out of their steps' rows."""
    taken = []
    for rows, index_of in records:
        index = index_of.get(request_id)
        if index is not None:
            taken.append(rows.take(index))
    return taken


class LogprobRows:
    """The `TokenLogprobs` of a batch's rows, made Python lists when first read: a step's rows
    are read when its requests finish or stream, and leave the step's time (one `.tolist()`
    per array then). A request `take`s its row once, which leaves the batch holding only the
    rows not taken yet."""

    __slots__ = ("_arrays", "_rows")

    def __init__(
        self, ids: Any, values: Any, ranks: Any, num_logprobs: Sequence[int], k: int
    ) -> None:
        self._arrays: Optional[tuple[Any, Any, Any, Sequence[int], int]] = (
            ids,
            values,
            ranks,
            num_logprobs,
            k,
        )
        self._rows: Optional[list[Optional[TokenLogprobs]]] = None

    def take(self, index: int) -> TokenLogprobs:
        """Row `index`, handed over: the batch forgets it (each row is taken once)."""
        rows = self._rows if self._rows is not None else self._materialize()
        row = rows[index]
        assert row is not None, f"logprob row {index} was taken already"
        rows[index] = None
        return row

    def __getitem__(self, index: int) -> Optional[TokenLogprobs]:
        rows = self._rows
        return (rows if rows is not None else self._materialize())[index]

    def __len__(self) -> int:
        return len(self._rows if self._rows is not None else self._materialize())

    def __iter__(self) -> Iterator[Optional[TokenLogprobs]]:
        return iter(self._rows if self._rows is not None else self._materialize())

    def _materialize(self) -> list[Optional[TokenLogprobs]]:
        assert self._arrays is not None
        ids, values, rank_array, num_logprobs, k = self._arrays
        id_rows, value_rows = ids.tolist(), values.tolist()
        ranks: Iterable[Optional[int]] = (
            itertools.repeat(None) if rank_array is None else rank_array.tolist()
        )
        rows: list[Optional[TokenLogprobs]]
        if min(num_logprobs, default=0) == k:  # every row asks for the same top k: as they are
            rows = list(zip(id_rows, value_rows, ranks))
        else:  # rows asking for fewer than k keep their first ones (ranked over all k first)
            rows = [
                (row[0][: count + 1], row[1][: count + 1], chosen_rank(row))
                for row, count in zip(zip(id_rows, value_rows, ranks), num_logprobs)
            ]
        self._rows, self._arrays = rows, None
        return rows


def chosen_rank(row: TokenLogprobs) -> int:
    """The chosen token's rank in `row`: as recorded, or (None) how many of the top k are at
    least as likely (the chosen token is above the k-th, so no other token can be)."""
    ids, values, rank = row
    if rank is not None:
        return rank
    chosen = values[0]
    return sum(value >= chosen for value in values[1:])


def logprob_top_k(
    logits: torch.Tensor, k: int, chosen_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`top_k` of the log-softmax of CPU `logits` [rows, vocab], without the log-softmax
    matrix where it can: `_core.logprob_top_k_rows_cpu` shifts each row's top k + 1 logits by
    the row's log-softmax (`log_softmax_rows_cpu`'s values to the bit, the ranks counted over
    them, the order the logits'). The rows it does not settle (ties, NaN, infinities) take `top_k` of
    their `log_softmax_rows_cpu` rows: torch's top k on the same values."""
    num_rows, vocab_size = logits.shape
    array = np.ascontiguousarray(logits.numpy())
    chosen = np.ascontiguousarray(chosen_ids, dtype=np.int64)
    if k >= vocab_size:
        logprobs = np.empty_like(array)
        log_softmax_rows_cpu(array, logprobs)
        return top_k(torch.from_numpy(logprobs), k, chosen)
    ids = np.empty((num_rows, k + 1), dtype=np.int64)
    values = np.empty((num_rows, k + 1), dtype=np.float32)
    ranks = np.empty(num_rows, dtype=np.int64)
    others = logprob_top_k_rows_cpu(array, k, chosen, ids, values, ranks)
    if others:
        logprobs = np.empty((len(others), vocab_size), dtype=np.float32)
        log_softmax_rows_cpu(array[others], logprobs)
        ids[others], values[others], ranks[others] = top_k(
            torch.from_numpy(logprobs), k, chosen[others]
        )
    return ids, values, ranks


def top_k(
    logprobs: torch.Tensor, k: int, chosen_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids and values [rows, 1 + k] of each row's chosen token (`chosen_ids`) and then its k
    largest, descending, and the chosen token's rank [rows] (the values at least its own), from
    CPU `logprobs` [rows, vocab].

    The native top k (`_core.top_k_rows_cpu`: a pass over each row that also counts the rank,
    then over the few chunks of it that can hold the top k) where a row's top k + 1 are
    strictly decreasing: then the top k is the only one there is and equals `torch.topk`'s.
    The other rows (ties, NaN, fewer than k + 1 finite values) take `torch.topk`, whose order
    among equal values is its own."""
    num_rows, vocab_size = logprobs.shape
    array = logprobs.numpy()
    chosen = np.ascontiguousarray(chosen_ids, dtype=np.int64)
    if k >= vocab_size or array.dtype != np.float32:
        ids = chosen.reshape(num_rows, 1)
        if k:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            ids = np.concatenate([ids, top_ids.numpy()], axis=1)
        values = array[np.arange(num_rows)[:, None], ids]
        return ids, values, (array >= values[:, :1]).sum(-1)
    ids = np.empty((num_rows, k + 1), dtype=np.int64)
    values = np.empty((num_rows, k + 1), dtype=np.float32)
    ranks = np.empty(num_rows, dtype=np.int64)
    others = top_k_rows_cpu(np.ascontiguousarray(array), k, chosen, ids, values, ranks)
    if others and k:
        other_values, other_ids = logprobs[torch.tensor(others)].topk(k, dim=-1)
        ids[others, 1:], values[others, 1:] = other_ids.numpy(), other_values.numpy()
    return ids, values, ranks


# Each token's own text, per tokenizer, decoded once (forgotten with the tokenizer).
_token_texts: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def logprob_dicts(
    rows: Iterable[TokenLogprobs], tokenizer: Optional[Any]
) -> list[dict[int, Logprob]]:
    """vLLM's form of `rows`: per position, token id -> `Logprob`, the chosen token first (a
    top-k token that is also the chosen one appears once). `decoded_token` is each token's own
    text when a tokenizer is given, else None."""
    rows = list(rows)
    texts: dict[int, str] = {}
    if tokenizer is not None:
        texts = _token_texts.setdefault(tokenizer, {})
        unique = sorted(set().union(*(row[0] for row in rows)) - texts.keys())
        if unique:
            texts.update(zip(unique, tokenizer.batch_decode([[token] for token in unique])))
    result = []
    for row in rows:
        ids, values, _ = row
        position = {ids[0]: Logprob(values[0], chosen_rank(row), texts.get(ids[0]))}
        for rank in range(1, len(ids)):
            token = ids[rank]
            if token not in position:
                position[token] = Logprob(values[rank], rank, texts.get(token))
        result.append(position)
    return result
