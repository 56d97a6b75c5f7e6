"""Host (CPU) memory for the KV cache, backed by transparent huge pages where Linux offers them.

The CPU attention kernel reads each request's blocks from wherever the allocator put them in the
pool; with 4 KiB pages a pool larger than the TLB's reach (a few MiB) turns most block reads into
page walks, and the kernel's software prefetches of upcoming blocks then stall. With 2 MiB pages
the whole pool stays within the TLB's reach. Measured (`scripts/bench_cpu_attention.py`-style
decode, 64 rows x 592 keys, blocks shuffled over a 16384-block pool, caches evicted between
calls): 1.05 ms per call on huge pages against 1.46 ms on 4 KiB pages.

`zeros(shape, dtype)`: a zero-filled CPU tensor in an anonymous mapping aligned to 2 MiB and
advised `MADV_HUGEPAGE` (the kernel's `transparent_hugepage` setting `madvise` or `always`
grants huge pages to it; `never` leaves 4 KiB pages, which only costs the speed-up). The
tensor keeps its mapping alive. Elsewhere (no `madvise`, or `HYBRID_CACHE_HUGE_PAGES=0` in the
environment) it is `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch

HUGE_PAGE_BYTES = 2 << 20
ENABLED = os.environ.get("HYBRID_CACHE_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of `shape`, on huge pages where possible (see the module)."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if not ENABLED or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -address % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # huge pages unavailable here: 4 KiB pages, same contents
    tensor = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(shape)
    # Anonymous memory reads as zero already; writing it faults every page in now, as
    # torch.zeros would, rather than during the first steps.
    tensor.zero_()
    return tensor
