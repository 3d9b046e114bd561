"""A least-recently-used mapping of bounded size for the distributed layer's memo tables.

Every distinct global shape is a new key: in variable-length training each batch brings new
ones, so an unbounded table would grow for ever. Entries past ``maxsize`` are dropped oldest
first; a dropped entry is recomputed on its next use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

DEFAULT_SIZE = 256


class BoundedCache:
    """``get``/``put`` with least-recently-used eviction once ``maxsize`` entries are held."""

    __slots__ = ("_data", "maxsize")

    def __init__(self, maxsize: int = DEFAULT_SIZE):
        if maxsize < 1:
            raise ValueError(f"maxsize: must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()

    def get(self, key: Hashable, default=None):
        try:
            value = self._data[key]
        except KeyError:
            return default
        self._data.move_to_end(key)
        return value

    def put(self, key: Hashable, value) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()
