"""Context parallel helpers: the head-tail (zig-zag) order of a sequence over cp ranks.

Causal attention gives later query rows more keys, so cutting a sequence into cp contiguous
shards leaves the last rank with most of the work. In head-tail order the sequence is cut into
2 * cp chunks and each rank holds one cheap and one expensive chunk. Two orders exist:

* ``"opmesh"``: rank r holds chunks r and 2 * cp - 1 - r (in that order);
* ``"hyperparallel"``: rank r holds chunks 2 * r and 2 * cp - 2 * r - 1 (in that order), the
  fold HyperParallel's context parallel uses.

For cp = 4 (chunks 0..7)::

    rank        0      1      2      3
    opmesh     0, 7   1, 6   2, 5   3, 4
    hyperpar.  0, 7   2, 5   4, 3   6, 1

``head_tail_cp(order)`` turns the order on for a block of code, ``set_head_tail_cp(order)``
for the whole process (None turns it off); the block's setting wins inside it.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()
_process_order: str | None = None
ORDERS = ("opmesh", "hyperparallel")


def _check_order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"order: expected 'opmesh' or 'hyperparallel', got {order!r}")
    return order


def chunk_pair(rank: int, cp_size: int, order: str = "opmesh") -> tuple[int, int]:
    """The two chunks (of 2 * cp_size) rank `rank` holds, in its local order."""
    if _check_order(order) == "opmesh":
        return rank, 2 * cp_size - 1 - rank
    return 2 * rank, 2 * cp_size - 2 * rank - 1


def _order(cp_size: int, order: str = "opmesh") -> list[int]:
    chunks = []
    for r in range(cp_size):
        chunks += list(chunk_pair(r, cp_size, order))
    return chunks


def _chunks(x: torch.Tensor, dim: int, cp_size: int) -> list[torch.Tensor]:
    if cp_size < 1:
        raise ValueError(f"cp_size: must be >= 1, got {cp_size}")
    size = x.shape[dim]
    if size % (2 * cp_size) != 0:
        raise ValueError(
            f"x: dim {dim} has size {size}, not a multiple of 2 * cp_size = {2 * cp_size}"
        )
    return list(torch.chunk(x, 2 * cp_size, dim=dim))


def _sequence_chunks(x, dim, cp_size, cu_seqlens):
    """Per sequence of a TND batch (cumulative lengths `cu_seqlens` from 0), its 2 * cp_size
    chunks along dim."""
    cu = [int(v) for v in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if not cu or cu[0] != 0 or cu[-1] != x.shape[dim]:
        raise ValueError(
            f"cu_seqlens: expected cumulative lengths from 0 to {x.shape[dim]} (dim {dim} of x), "
            f"got {cu}"
        )
    out = []
    for b in range(len(cu) - 1):
        length = cu[b + 1] - cu[b]
        if length < 0 or length % (2 * cp_size) != 0:
            raise ValueError(
                f"cu_seqlens: sequence {b} has {length} tokens, not a multiple of 2 * cp_size = "
                f"{2 * cp_size}, as head-tail order needs"
            )
        out.append(list(torch.chunk(x.narrow(dim, cu[b], length), 2 * cp_size, dim=dim)))
    return out


def to_head_tail(
    x: torch.Tensor, dim: int, cp_size: int, order: str = "opmesh", *, cu_seqlens=None
) -> torch.Tensor:
    """Reorders dim of x so that sharding it over cp_size ranks gives each rank its two chunks
    of the original order (see the module's table for the two orders).

    With ``cu_seqlens`` (a TND batch's cumulative lengths from 0), every sequence is cut into
    2 * cp_size chunks (its length must be a multiple of that): rank r's shard holds, sequence by
    sequence, that sequence's two chunks of rank r."""
    if cu_seqlens is None:
        chunks = _chunks(x, dim, cp_size)
        return torch.cat([chunks[i] for i in _order(cp_size, order)], dim=dim)
    if cp_size < 1:
        raise ValueError(f"cp_size: must be >= 1, got {cp_size}")
    per_sequence = _sequence_chunks(x, dim, cp_size, cu_seqlens)
    parts = [
        chunks[c]
        for r in range(cp_size)
        for chunks in per_sequence
        for c in chunk_pair(r, cp_size, order)
    ]
    return torch.cat(parts, dim=dim) if parts else x


def from_head_tail(
    x: torch.Tensor, dim: int, cp_size: int, order: str = "opmesh", *, cu_seqlens=None
) -> torch.Tensor:
    """Inverse of to_head_tail (with the same ``cu_seqlens``, the sequences' natural lengths)."""
    if cu_seqlens is None:
        chunks = _chunks(x, dim, cp_size)
        inverse = [0] * (2 * cp_size)
        for position, chunk in enumerate(_order(cp_size, order)):
            inverse[chunk] = position
        return torch.cat([chunks[inverse[i]] for i in range(2 * cp_size)], dim=dim)
    if cp_size < 1:
        raise ValueError(f"cp_size: must be >= 1, got {cp_size}")
    # The chunk sizes are the natural order's; find each chunk's place in x.
    sizes = [
        [c.shape[dim] for c in chunks] for chunks in _sequence_chunks(x, dim, cp_size, cu_seqlens)
    ]
    where = {}
    offset = 0
    for r in range(cp_size):
        for b, chunk_sizes in enumerate(sizes):
            for c in chunk_pair(r, cp_size, order):
                where[(b, c)] = offset
                offset += chunk_sizes[c]
    parts = [
        x.narrow(dim, where[(b, c)], chunk_sizes[c])
        for b, chunk_sizes in enumerate(sizes)
        for c in range(2 * cp_size)
    ]
    return torch.cat(parts, dim=dim) if parts else x


_UNSET = object()


@contextlib.contextmanager
def head_tail_cp(order: str = "opmesh"):
    """Within this block, ops whose query sequence is sharded for context parallelism take their
    sequence-sharded inputs (and give their outputs) in head-tail order `order`."""
    _check_order(order)
    previous = getattr(_state, "order", _UNSET)
    _state.order = order
    try:
        yield
    finally:
        if previous is _UNSET:
            del _state.order
        else:
            _state.order = previous


def set_head_tail_cp(order: str | None) -> None:
    """Turns head-tail order on for the whole process (`order`), or off (None). A
    ``head_tail_cp`` block overrides it inside the block."""
    global _process_order
    _process_order = None if order is None else _check_order(order)


def head_tail_order() -> str | None:
    """The head-tail order in force here, or None."""
    return getattr(_state, "order", _process_order)


def head_tail_enabled() -> bool:
    return head_tail_order() is not None


def keys_seen(row_end: int, q_len: int, k_len: int, right: int = -1) -> int:
    """How many leading keys of a sequence (``q_len`` queries, ``k_len`` keys, the mask's
    diagonal aligned bottom-right) its query rows before ``row_end`` can see: all of them when
    the mask has no right bound (``right = -1``), else those up to the last row's diagonal plus
    ``right`` keys (``0``: causal). Every context-parallel strategy cuts a rank's keys with it,
    so that each of its rows keeps exactly the keys it sees in the global call."""
    if right < 0:
        return k_len
    return max(0, min(k_len, row_end + k_len - q_len + right))


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
