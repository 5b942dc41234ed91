"""Freed memory handed back to the system once the caches have dropped enough of it.

A server that sees many distinct schemas fills its bounded caches and then keeps evicting: KV
prefixes, plans, JSON-schema models. Python and PyTorch free what is evicted, but glibc's allocator
keeps the freed pages in its heaps, so the process's resident memory keeps growing long after the
caches are full (measured in docs/benchmarks.md: +366 MiB over 500 schemas, all of it returned by
one `malloc_trim`). `MemoryReleaser` runs on the model worker after each job and trims once the
prefix cache has evicted `every_bytes` since the last trim, so a server with a steady set of
schemas never pays for it. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

from pcd_engine import PrefixCache

log = logging.getLogger("minicpm_pcd.server")


def malloc_trim() -> bool:
    """glibc's `malloc_trim(0)`: free heap pages back to the system; False where there is none."""
    try:
        libc: Any = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


class MemoryReleaser:
    """Called after each job on the model worker: trims once `cache` has evicted `every_bytes`."""

    def __init__(self, cache: PrefixCache | None, every_bytes: int = 64 * 2**20) -> None:
        self.cache, self.every_bytes = cache, every_bytes
        self.trims = 0
        self._evicted_then = 0

    def __call__(self) -> None:
        if self.cache is None:
            return
        evicted = self.cache.stats.evicted_bytes
        if evicted - self._evicted_then >= self.every_bytes:
            self._evicted_then = evicted
            if malloc_trim():
                self.trims += 1
                log.debug("returned freed memory to the system (trim %d)", self.trims)
