"""BoundedCache: a thread-safe least-recently-used map with a fixed number of entries.

Everything the engine keeps per client input (plans per schema and instructions, tool plans, models
built from JSON-schema dicts) lives in one of these, so a server answering many distinct schemas or
system texts stays at a bounded size; `clear()` empties one, and `size` / `max_entries` are what
`/metrics` publishes.

    >>> cache = BoundedCache(2)
    >>> [cache.get_or_build(k, lambda: k * 10) for k in (1, 2, 1, 3)]
    [10, 20, 10, 30]
    >>> sorted(cache.keys()), cache.evictions
    ([1, 3], 1)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """At most `max_entries` values; the least recently used goes first. A value is built outside the
    lock (two threads may build the same one; the first stored wins)."""

    def __init__(self, max_entries: int) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self.evictions = 0
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V, replace: bool = False) -> V:
        """Store `value` unless the key is there already (or with `replace`); the stored value."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None and not replace:
                self._entries.move_to_end(key)
                return found
            self._entries[key] = value
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1
            return value

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        found = self.get(key)
        return found if found is not None else self.put(key, build())

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._entries)

    @property
    def size(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


__all__ = ["BoundedCache"]
