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

`available_bytes()`: the host memory a new allocation can still get (Linux `MemAvailable`, capped
by a cgroup v2 memory limit), which `memory.check_kv_cache_fits` holds the CPU KV cache to.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from pathlib import Path
from typing import Optional

import torch

from hybrid_cache.errors import KVCacheMemoryError

HUGE_PAGE_BYTES = 2 << 20
ENABLED = os.environ.get("HYBRID_CACHE_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def available_bytes() -> Optional[int]:
    """Bytes of host memory still available (`MemAvailable`, within the cgroup's `memory.max`
    where one is set); None where neither can be read (not Linux)."""
    figures = []
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                figures.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            figures.append(int(limit) - int((CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(figures) if figures else None


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of `shape`, on huge pages where possible (see the module)."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if not ENABLED or nbytes < HUGE_PAGE_BYTES:
        try:
            return torch.zeros(shape, dtype=dtype)
        except RuntimeError as error:  # torch's CPU allocator out of memory
            raise KVCacheMemoryError(
                f"the host refused {nbytes} B for a KV-cache tensor ({error}); lower "
                "--kv-cache-memory (LLM argument kv_cache_memory)"
            ) from error
    try:
        mapping = mmap.mmap(
            -1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
    except OSError as error:
        raise KVCacheMemoryError(
            f"the host refused {nbytes} B for a KV-cache tensor ({error}); lower "
            "--kv-cache-memory (LLM argument kv_cache_memory)"
        ) from error
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
