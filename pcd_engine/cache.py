"""PrefixCache: KV caches of recent prompt prefixes, reused by the longest common token prefix.

Entries are keyed by token ids and never mutated: a hit returns a private copy, cropped to the common
length. For transformers' `DynamicCache` the copy shares the stored tensors (its layers only ever
rebind their tensors: `update` concatenates into new ones, `crop` slices), so a hit costs no tensor
memory; any other cache type is deep-copied. The cache is bounded in bytes (least recently used
entries go first) and safe under threads.

`frozen_view` serves a stored prefix to one forward call that must not keep anything: each layer
attends over the prefix (repeated over the batch rows as a view) plus the call's new tokens, and
keeps none of them, so the new keys and values of a layer are freed once its attention is done.
`kept_view` is the same for a call whose own tokens a later call reads (a shortlist's second pass on
the first pass's trees): it keeps the call's keys and values, apart from the prefix and once per row,
so the prefix is never copied per row; `freeze` then serves prefix and kept tokens to that later call.
The engine stores the per-schema prompt head, so every request with the same schema and instructions
computes only its own text, the assistant start and the branches.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evicted_bytes: int = 0  # of the prefixes dropped to stay within max_bytes, all told


class PrefixCache:
    def __init__(self, max_bytes: int = 512 * 2**20) -> None:
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[int, ...], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def lookup(self, ids: Sequence[int]) -> tuple[Any, int]:
        """(private KV copy, number of leading tokens it covers); (None, 0) on a miss."""
        with self._lock:
            best, best_len = None, 0
            for key in self._entries:
                n = _common_prefix(key, ids)
                if n > best_len:
                    best, best_len = key, n
            if best is None:
                self.stats.misses += 1
                return None, 0
            self._entries.move_to_end(best)
            kv, _ = self._entries[best]
            self.stats.hits += 1
            self.stats.reused_tokens += best_len
            private = private_copy(kv)
        if best_len < len(best):
            private.crop(-(len(best) - best_len))
        return private, best_len

    def store(self, ids: Sequence[int], kv: Any) -> None:
        """Keep a private copy of `kv`, which must hold exactly the KV of `ids`."""
        key = tuple(ids)
        size = _nbytes(kv)
        if size > self.max_bytes:
            return
        entry = private_copy(kv)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = (entry, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
                self.stats.evicted_bytes += dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored prefixes."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


def private_copy(kv: Any) -> Any:
    """A copy of `kv` that its user may grow or crop without changing `kv` (shares tensors where safe)."""
    if not _dynamic(kv):
        return copy.deepcopy(kv)
    return copy.deepcopy(kv, memo={id(t): t for t in _tensors(kv, depth=0)})


def frozen_view(kv: Any, rows: int = 1) -> Any:
    """A cache over `kv` for one forward call of `rows` rows that keeps none of the call's tokens;
    None when `kv` is not a plain DynamicCache (the caller then copies it)."""
    if not _dynamic(kv):
        return None
    view = private_copy(kv)
    for layer in view.layers:
        layer.__class__ = _FrozenLayer
        layer.rows = rows
    return view


def kept_view(kv: Any, rows: int = 1) -> Any:
    """`frozen_view`, but the call's own keys and values are kept (per row, after the prefix) for a
    later call; None when `kv` is not a plain DynamicCache."""
    view = frozen_view(kv, rows)
    if view is not None:
        for layer in view.layers:
            layer.__class__ = _KeptLayer
            layer.own_keys = layer.own_values = None
    return view


def can_freeze(kv: Any) -> bool:
    """Whether `freeze` serves `kv` without copying it (a kept view, or a plain DynamicCache)."""
    return _kept(kv) or _dynamic(kv)


def freeze(kv: Any, rows: int) -> Any:
    """A cache for one more call of `rows` rows over everything `kv` holds (a `kept_view` after its call,
    or a DynamicCache the model grew), which keeps nothing of that call."""
    if _kept(kv):
        view = copy.copy(kv)
        view.layers = [copy.copy(layer) for layer in kv.layers]
        for layer in view.layers:
            assert isinstance(layer, _KeptLayer)
            layer.keeping = False
        return view
    view = frozen_view(kv, rows)
    if view is None:
        raise TypeError(f"cannot serve a {type(kv).__name__} to a later call without copying it")
    return view


def _kept(kv: Any) -> bool:
    """Whether `kv` is a `kept_view` (every layer a _KeptLayer)."""
    layers = kv.layers if isinstance(kv, DynamicCache) else []
    return bool(layers) and all(isinstance(layer, _KeptLayer) for layer in layers)


def _dynamic(kv: Any) -> bool:
    if type(kv) is not DynamicCache:
        return False
    return bool(kv.layers) and all(type(layer) is DynamicLayer for layer in kv.layers)


class _FrozenLayer(DynamicLayer):
    """A DynamicLayer whose `update` returns the stored prefix (as `rows` rows) plus the new keys and
    values, and stores nothing."""

    rows = 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        shape = (self.rows, -1, -1, -1)
        keys = torch.cat([self.keys.expand(shape), key_states], dim=-2)
        values = torch.cat([self.values.expand(shape), value_states], dim=-2)
        return keys, values


class _KeptLayer(DynamicLayer):
    """A `_FrozenLayer` that keeps the call's own keys and values (`own_keys`, `rows` rows) apart from
    the stored prefix, and serves both to the next call; with `keeping` off it adds nothing more."""

    rows = 1
    keeping = True
    own_keys: torch.Tensor | None = None
    own_values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        shape = (self.rows, -1, -1, -1)
        own_keys, own_values = key_states, value_states
        if self.own_keys is not None and self.own_values is not None:
            own_keys = torch.cat([self.own_keys, key_states], dim=-2)
            own_values = torch.cat([self.own_values, value_states], dim=-2)
        if self.keeping:
            self.own_keys, self.own_values = own_keys, own_values
        keys = torch.cat([self.keys.expand(shape), own_keys], dim=-2)
        values = torch.cat([self.values.expand(shape), own_values], dim=-2)
        return keys, values

    def get_seq_length(self) -> int:
        own = self.own_keys.shape[-2] if self.own_keys is not None else 0
        return super().get_seq_length() + own


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _nbytes(kv: Any) -> int:
    seen: set[int] = set()
    total = 0
    for value in _tensors(kv, depth=0):
        if id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
    return total


def _tensors(obj: Any, depth: int) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 4:
        return []
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item, depth + 1)]
    if hasattr(obj, "__dict__"):
        return [t for item in vars(obj).values() for t in _tensors(item, depth + 1)]
    return []
