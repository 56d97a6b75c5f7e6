"""Pure-decode forwards replayed from CUDA graphs, one graph per batch-size bucket.

A decode step's forward launches a few hundred small operators and Triton kernels; issued one by
one from Python they take longer on the host than on the device (a gemma-3-12b decode layer:
1.2 ms to issue, 0.37-0.48 ms to run). A CUDA graph records the launches once and replays them
in one call. What a replay reads must then sit at fixed addresses, so the step's inputs are
copied into static device buffers first:

    int64   input ids [B] | positions [B] | each group's slot mapping [B]
    int32   sequence lengths [B] | each group's block table [B, max_model_len / block_size]

A batch of n sequences runs in the smallest bucket B >= n (powers of two up to the runner's
largest batch, which is a bucket too); rows n..B are padding: slot -1 (the cache write skips
it), length 1, position 0. A bucket's graph is captured the first time a decode step needs it:
one eager forward on the static buffers (first calls, lazy state), then the capture, both
under this step's inputs, so the step's own output comes from the replay. The attention
kernels are planned for `max_model_len` (their split count then fits any step the bucket
meets), so a replay's floating-point sums may be grouped differently from an eager step's: the
tokens agree wherever the logits are not near-tied (scripts/gpu_engine_check.py).

Steps with prefill chunks, tail replays or sequences beyond the largest bucket run eagerly, as
does every step after a recording failed (`GraphCaptureError`, logged) and everything with
`enforce_eager`, on the CPU and under tensor parallelism. A model may cap the recorded batch
size (`max_cuda_graph_batch`: gpt-oss, whose recorded experts run densely).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch
from torch import nn

from hybrid_cache.attention import AttentionMetadata, GroupMetadata, set_forward_context
from hybrid_cache.attention.layer import attention_layers


class GraphCaptureError(RuntimeError):
    """A decode forward could not be recorded (the model runner then runs eagerly)."""


class Graph(Protocol):
    """A recorded forward: `capture(fn)` runs `fn` once and records it, returns its output;
    `replay()` runs the recording again (writing the same output tensor)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """`Graph` on CUDA: `torch.cuda.CUDAGraph`, every bucket's graph in one memory pool."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two below `max_batch`, then `max_batch`."""
    buckets = [1 << power for power in range(max_batch.bit_length()) if 1 << power < max_batch]
    return [*buckets, max_batch]


def supports_decode_graphs(model: nn.Module, device: torch.device) -> bool:
    """Whether `model`'s decode forward can be recorded: on CUDA, every attention layer on the
    Triton backend."""
    if device.type != "cuda":
        return False
    return all(layer.backend == "triton" for layer in attention_layers(model))


class DecodeGraphs:
    """The static buffers and the per-bucket graphs of one model runner (see the module docs).
    `make_graph()` makes an empty `Graph` (default: `CudaGraph` sharing one pool)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_sizes: Sequence[int],
        max_model_len: int,
        max_batch: int,
        device: torch.device,
        make_graph: Optional[Callable[[], Graph]] = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_sizes = [int(size) for size in block_sizes]
        self.max_model_len = int(max_model_len)
        self.buckets = decode_buckets(max_batch)
        self.device = device
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.make_graph = make_graph
        groups = len(self.block_sizes)
        self.widths = [-(-self.max_model_len // size) for size in self.block_sizes]
        # Host staging (pinned on CUDA: the copies to the device do not wait) and the static
        # device buffers, laid out alike (module docs).
        pinned = device.type == "cuda"
        self.host64 = torch.zeros((2 + groups, max_batch), dtype=torch.int64, pin_memory=pinned)
        self.host_lens = torch.ones(max_batch, dtype=torch.int32, pin_memory=pinned)
        self.host_tables = [
            torch.zeros((max_batch, width), dtype=torch.int32, pin_memory=pinned)
            for width in self.widths
        ]
        self.ids64 = torch.zeros((2 + groups, max_batch), dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.tables = [
            torch.zeros((max_batch, width), dtype=torch.int32, device=device)
            for width in self.widths
        ]
        self.query_starts = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # bucket -> (graph, its output hidden states [bucket, hidden])
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.num_replays = 0

    def bucket_of(self, num_seqs: int) -> Optional[int]:
        """The bucket a batch of `num_seqs` runs in, None past the largest."""
        if num_seqs <= 0:
            return None
        return next((bucket for bucket in self.buckets if bucket >= num_seqs), None)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode step of n sequences (n <= max_batch), from
        its host-side inputs (`DecodeInputBuffers.build`): copied into the static buffers, the
        bucket's graph replayed (captured first when new). The result is a view of the graph's
        output, valid until the next step."""
        num_seqs = int(positions.shape[0])
        bucket = self.bucket_of(num_seqs)
        assert bucket is not None, f"a decode batch of {num_seqs} exceeds the graphs' buckets"
        self._stage(input_ids, positions, metadata, num_seqs, bucket)
        entry = self.graphs.get(bucket)
        if entry is None:
            forward = self._forward(bucket)
            forward()  # eager, on this step's inputs: first calls and lazy state outside capture
            graph = self.make_graph()
            try:
                output = graph.capture(forward)
            except Exception as error:
                raise GraphCaptureError(
                    f"recording the decode forward of a batch of {bucket} failed: {error}"
                ) from error
            self.graphs[bucket] = entry = (graph, output)
        graph, output = entry
        graph.replay()
        self.num_replays += 1
        return output[:num_seqs]

    def _stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        num_seqs: int,
        bucket: int,
    ) -> None:
        """This step's inputs into the static buffers, rows num_seqs..bucket as padding."""
        host64, lens = self.host64, self.host_lens
        host64[0, :num_seqs] = input_ids
        host64[1, :num_seqs] = positions
        lens[:num_seqs] = metadata.seq_lens
        if bucket > num_seqs:
            host64[:2, num_seqs:bucket] = 0
            host64[2:, num_seqs:bucket] = -1  # padding writes no KV
            lens[num_seqs:bucket] = 1
        for group, (meta, table) in enumerate(zip(metadata.groups, self.host_tables)):
            host64[2 + group, :num_seqs] = meta.slot_mapping
            width = meta.block_table.shape[1]
            table[:num_seqs, :width] = meta.block_table
        # Whole (a contiguous pinned copy stays asynchronous; rows past the bucket are unread).
        self.ids64.copy_(host64, non_blocking=True)
        self.seq_lens[:bucket].copy_(lens[:bucket], non_blocking=True)
        for device_table, table in zip(self.tables, self.host_tables):
            device_table[:bucket].copy_(table[:bucket], non_blocking=True)

    def _forward(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The forward over the first `bucket` rows of the static buffers. Every tensor is a
        fresh view, so caches that earlier steps left on Python objects are not reused."""

        def forward() -> torch.Tensor:
            groups = [
                GroupMetadata(
                    block_table=table[:bucket],
                    slot_mapping=self.ids64[2 + group, :bucket],
                    block_size=size,
                )
                for group, (table, size) in enumerate(zip(self.tables, self.block_sizes))
            ]
            metadata = AttentionMetadata(
                query_start_loc=self.query_starts[: bucket + 1],
                seq_lens=self.seq_lens[:bucket],
                groups=groups,
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            with set_forward_context(metadata, self.kv_caches):
                return self.model(self.ids64[0, :bucket], self.ids64[1, :bucket])

        return forward
