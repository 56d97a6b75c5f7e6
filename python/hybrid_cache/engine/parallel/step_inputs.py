"""One step's inputs as every tensor-parallel rank needs them, and their wire form.

Rank 0 (the driver: scheduler, allocator, sampler) gathers a step into a `StepInputs`: the
input token ids, each scheduled sequence's computed-token count and query length, its rows of
every group's block table (the columns the step can reach), the step's block copies, and the
hidden rows the step computes logits of (a vocabulary-parallel LM head is a collective every
rank calls alike: the prompt-logprob rows, in chunks of `PROMPT_LOGPROBS_CHUNK`, then the
sampled rows). Every rank, rank 0 included, then builds the same attention metadata from it
(`step_batch`), so the ranks cannot disagree on a slot or a position.

On the wire a step is int32: a header of `HEADER_FIELDS` values, then the payload

    input_ids [T] | num_computed [n] | query_lens [n] (absent in a decode step) |
    write_from [n] (only while a tail replay runs) | block tables [G, n, C] | block copies [K, 2] |
    prompt rows [P] | sample rows [S] (absent when every row samples, as in a decode step)

sent inside the header message when it fits `inline` values (one broadcast per step), else
in a second broadcast (`step_broadcast.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from hybrid_cache.attention import AttentionMetadata, build_attention_metadata
from hybrid_cache.attention.decode_inputs import build_decode_metadata

# Header: operation, n, T, G, C, K, decode flag, payload length, P, S (-1: every row),
# write_from flag.
HEADER_FIELDS = 11
OP_STEP = 1
OP_STOP = 2
ALL_ROWS = -1
# Prompt positions whose logits one `compute_logits` call computes for prompt logprobs.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class StepInputs:
    """What every rank's forward needs (`decode`: every query length is 1, `query_lens` is
    then implied). `block_tables` [groups, seqs, columns] int32; `block_copies` [K, 2];
    `prompt_rows` / `sample_rows`: the hidden rows of the step's prompt-logprob and sampling
    logits (`sample_rows` None: every row, in order); `write_from` [seqs]: tail-replay
    frontiers (full-attention KV below them is not written), None when no sequence replays."""

    input_ids: np.ndarray
    num_computed: np.ndarray
    query_lens: Optional[np.ndarray]
    block_tables: np.ndarray
    block_copies: np.ndarray
    prompt_rows: np.ndarray
    sample_rows: Optional[np.ndarray]
    write_from: Optional[np.ndarray] = None

    @property
    def num_seqs(self) -> int:
        return len(self.num_computed)

    @property
    def decode(self) -> bool:
        return self.query_lens is None


def gather_step_inputs(
    token_ids: Sequence[int],
    num_computed: Sequence[int],
    query_lens: Sequence[int],
    rows: Sequence[int],
    block_table: np.ndarray,
    block_sizes: Sequence[int],
    block_copies: Sequence[tuple[int, int]],
    prompt_rows: Sequence[int] = (),
    sample_rows: Optional[Sequence[int]] = None,
    write_from: Optional[Sequence[int]] = None,
) -> StepInputs:
    """A step from the scheduler's view: `rows` of the core's grouped `block_table`, only the
    columns the step reaches (the smallest block size's count); the logit rows as
    `StepInputs` holds them; `write_from`: the sequences' tail-replay frontiers when one of
    them replays (None otherwise)."""
    decode = len(token_ids) == len(num_computed) and write_from is None
    max_seq_len = max(map(int.__add__, num_computed, query_lens)) if num_computed else 0
    columns = -(-max_seq_len // min(block_sizes))
    return StepInputs(
        input_ids=np.array(token_ids, dtype=np.int64),
        num_computed=np.array(num_computed, dtype=np.int64),
        query_lens=None if decode else np.array(query_lens, dtype=np.int64),
        block_tables=block_table[:, list(rows), :columns],
        block_copies=np.array(block_copies, dtype=np.int64).reshape(-1, 2),
        prompt_rows=np.array(prompt_rows, dtype=np.int64),
        sample_rows=None if sample_rows is None else np.array(sample_rows, dtype=np.int64),
        write_from=None if write_from is None else np.array(write_from, dtype=np.int64),
    )


def sampled_rows(query_lens: Sequence[int], sampling: Sequence[int]) -> Optional[list[int]]:
    """The hidden rows of the last tokens of the sequences `sampling` (batch indices); None
    when that is every row, in order (a pure decode step)."""
    if len(sampling) == sum(query_lens):
        return None
    ends = list(itertools.accumulate(query_lens))
    return [ends[index] - 1 for index in sampling]


def step_batch(
    inputs: StepInputs, block_sizes: Sequence[int], read_only_groups: Sequence[int] = ()
) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The step's input ids, attention metadata and positions (on the CPU); the same on every
    rank for the same `inputs`. `read_only_groups`: the full-attention groups, which write no
    K/V below a tail replay's frontier."""
    num_computed = inputs.num_computed.tolist()
    tables = inputs.block_tables
    if inputs.decode:
        metadata, positions = build_decode_metadata(
            num_computed, range(inputs.num_seqs), tables, block_sizes
        )
    else:
        query_lens = inputs.query_lens.tolist()
        max_seq_len = max(map(int.__add__, num_computed, query_lens))
        group_tables = [
            torch.from_numpy(tables[group, :, : -(-max_seq_len // size)])
            for group, size in enumerate(block_sizes)
        ]
        write_from = None if inputs.write_from is None else inputs.write_from.tolist()
        metadata, positions = build_attention_metadata(
            query_lens,
            num_computed,
            group_tables,
            block_sizes,
            write_from=write_from,
            read_only_groups=read_only_groups,
        )
    return torch.from_numpy(inputs.input_ids), metadata, positions


def pack(inputs: StepInputs, header: np.ndarray) -> np.ndarray:
    """Writes the header into `header` [HEADER_FIELDS + inline] and returns the payload
    (int32), written after the header too when it fits there."""
    n, num_tokens = inputs.num_seqs, len(inputs.input_ids)
    groups, _, columns = inputs.block_tables.shape
    parts = [inputs.input_ids, inputs.num_computed]
    if not inputs.decode:
        parts.append(inputs.query_lens)
    if inputs.write_from is not None:
        parts.append(inputs.write_from)
    parts += [inputs.block_tables.reshape(-1), inputs.block_copies.reshape(-1)]
    parts.append(inputs.prompt_rows)
    if inputs.sample_rows is not None:
        parts.append(inputs.sample_rows)
    length = sum(map(len, parts))
    header[:HEADER_FIELDS] = (
        OP_STEP,
        n,
        num_tokens,
        groups,
        columns,
        len(inputs.block_copies),
        int(inputs.decode),
        length,
        len(inputs.prompt_rows),
        ALL_ROWS if inputs.sample_rows is None else len(inputs.sample_rows),
        int(inputs.write_from is not None),
    )
    inline = len(header) - HEADER_FIELDS
    payload = header[HEADER_FIELDS : HEADER_FIELDS + length] if length <= inline else None
    if payload is None:
        payload = np.empty(length, dtype=np.int32)
    start = 0
    for part in parts:
        payload[start : start + len(part)] = part
        start += len(part)
    return payload


def payload_length(header: np.ndarray) -> int:
    return int(header[7])


def unpack(header: np.ndarray, payload: np.ndarray) -> StepInputs:
    """The `StepInputs` of a header and its payload (`pack`'s inverse)."""
    fields = header[:HEADER_FIELDS].tolist()
    _, n, num_tokens, groups, columns, copies, decode, _, prompt, sample, replaying = fields
    lengths = [num_tokens, n, 0 if decode else n, n if replaying else 0]
    lengths += [groups * n * columns, 2 * copies, prompt, max(sample, 0)]
    ends = np.cumsum(lengths, dtype=np.int64)
    parts = np.split(payload[: ends[-1]], ends[:-1])
    ids, computed, lens, write_from, tables, pairs, prompt_rows, rows = parts
    return StepInputs(
        input_ids=ids.astype(np.int64),
        num_computed=computed.astype(np.int64),
        query_lens=None if decode else lens.astype(np.int64),
        block_tables=tables.reshape(groups, n, columns),
        block_copies=pairs.astype(np.int64).reshape(-1, 2),
        prompt_rows=prompt_rows.astype(np.int64),
        sample_rows=None if sample == ALL_ROWS else rows.astype(np.int64),
        write_from=write_from.astype(np.int64) if replaying else None,
    )
