"""Context parallel helpers: the head-tail (zig-zag) order of a sequence over cp ranks.

Causal attention gives later query rows more keys, so cutting a sequence into cp contiguous
shards leaves the last rank with most of the work. In head-tail order the sequence is cut into
2 * cp chunks and rank r holds chunks r and 2 * cp - 1 - r: one cheap and one expensive chunk
each.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()


def _order(cp_size: int) -> list[int]:
    order = []
    for r in range(cp_size):
        order += [r, 2 * cp_size - 1 - r]
    return order


def _chunks(x: torch.Tensor, dim: int, cp_size: int) -> list[torch.Tensor]:
    if cp_size < 1:
        raise ValueError(f"cp_size: must be >= 1, got {cp_size}")
    size = x.shape[dim]
    if size % (2 * cp_size) != 0:
        raise ValueError(
            f"x: dim {dim} has size {size}, not a multiple of 2 * cp_size = {2 * cp_size}"
        )
    return list(torch.chunk(x, 2 * cp_size, dim=dim))


def to_head_tail(x: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """Reorders dim of x so that sharding it over cp_size ranks gives rank r the chunks r and
    2 * cp_size - 1 - r of the original order."""
    chunks = _chunks(x, dim, cp_size)
    return torch.cat([chunks[i] for i in _order(cp_size)], dim=dim)


def from_head_tail(x: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """Inverse of to_head_tail."""
    chunks = _chunks(x, dim, cp_size)
    inverse = [0] * (2 * cp_size)
    for position, chunk in enumerate(_order(cp_size)):
        inverse[chunk] = position
    return torch.cat([chunks[inverse[i]] for i in range(2 * cp_size)], dim=dim)


@contextlib.contextmanager
def head_tail_cp():
    """Within this block, ops whose query sequence is sharded for context parallelism take their
    sequence-sharded inputs (and give their outputs) in head-tail order."""
    previous = getattr(_state, "head_tail", False)
    _state.head_tail = True
    try:
        yield
    finally:
        _state.head_tail = previous


def head_tail_enabled() -> bool:
    return getattr(_state, "head_tail", False)


def causal_work_per_rank(s1: int, s2: int, cp_size: int, head_tail: bool) -> list[int]:
    """Visible (query, key) pairs each rank computes for one causal sequence (bottom-right
    aligned) whose s1 queries are sharded over cp_size ranks."""

    def pairs(rows):
        return sum(max(0, min(s2, i + s2 - s1 + 1)) for i in rows)

    if not head_tail:
        chunk = -(-s1 // cp_size)
        return [pairs(range(r * chunk, min(s1, (r + 1) * chunk))) for r in range(cp_size)]
    chunk = s1 // (2 * cp_size)
    return [
        pairs(range(r * chunk, (r + 1) * chunk))
        + pairs(range((2 * cp_size - 1 - r) * chunk, (2 * cp_size - r) * chunk))
        for r in range(cp_size)
    ]
