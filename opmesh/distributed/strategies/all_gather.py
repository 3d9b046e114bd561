"""Context parallel by all-gather: what each rank computes and which keys its rows keep.

The query sequence is sharded over one or more mesh axes. Key-side tensors sharded like it are
all-gathered there (``gather``: DTensor's redistribute, whose backward reduce-scatters their
gradients), and arrive in the query's shard order; ``natural_order`` puts them back. Each rank
then computes its query rows in one or two pieces (``bsnd_pieces``, ``tnd_pieces``): its
contiguous shard, or in head-tail order its two chunks apart. A piece says, per sequence, how
many of its rows it holds and how many leading keys those rows can see (``keys_seen``: the
mask's diagonal stays where the global call has it), so that every row keeps exactly its global
key range. Operators write a piece's counts into their own length arguments; ``join_rows`` puts
the pieces' query-side outputs back in the rank's row order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import gather_cache
from ..context_parallel import chunk_pair, from_head_tail, keys_seen


def gather(p, x, mesh, axes):
    """``x`` all-gathered over the mesh ``axes`` (differentiable; one gather per distinct shard
    inside ``opmesh.gather_once()``)."""
    placements = list(p.placements_of(x))
    for axis in axes:
        placements[axis] = p.replicate()
    return gather_cache.gathered(x, mesh, tuple(placements))


def natural_order(x, dim, cp, order, cu_seqlens=None):
    """A tensor gathered over the context-parallel axis in head-tail order, in the sequence's
    natural order (``order`` None: as it is)."""
    if order is None:
        return x
    return from_head_tail(x, dim, cp, order, cu_seqlens=cu_seqlens)


@dataclass
class Piece:
    """One local call's query rows and the keys they keep.

    ``rows`` selects the piece's rows along the rank's query sequence (a slice, or an index of
    rows); per sequence, ``q_used`` counts its rows in the piece, ``k_used`` the leading keys
    those rows can see, and ``k_len`` all its keys. In BSND every sequence's piece is its
    global rows ``[start, start + count)`` (``q_used`` clips them to the sequence's rows)."""

    rows: object
    q_used: list
    k_used: list
    k_len: list
    start: int = 0
    count: int = 0

    @property
    def whole(self) -> bool:
        """The piece is all of the rank's rows, in order."""
        return isinstance(self.rows, slice) and self.rows == slice(None)

    @property
    def cuts_keys(self) -> bool:
        return self.k_used != self.k_len


def bsnd_pieces(q_len, k_len, rows, right, cp, rank, order, s1):
    """The pieces of a rank holding query rows ``rows = [r0, r1)`` of each sequence (or, in
    head-tail order, its two chunks of ``s1 // (2 cp)`` rows), for sequences of ``q_len[b]``
    query rows and ``k_len[b]`` keys under a mask whose right bound is ``right`` (``-1``: none,
    ``0``: causal)."""
    if order is None:
        r0, r1 = rows
        return [_bsnd_piece(slice(None), r0, r1 - r0, q_len, k_len, right)]
    chunk = s1 // (2 * cp)
    return [
        _bsnd_piece(slice(half * chunk, (half + 1) * chunk), c * chunk, chunk, q_len, k_len, right)
        for half, c in enumerate(chunk_pair(rank, cp, order))
    ]


def _bsnd_piece(rows, start, count, q_len, k_len, right):
    """Local rows are global rows [start, start + count) of each sequence."""
    q_used = [max(0, min(count, n - start)) for n in q_len]
    k_used = [
        keys_seen(start + qu, ql, kl, right)
        for ql, kl, qu in zip(q_len, k_len, q_used, strict=True)
    ]
    return Piece(rows, q_used, k_used, list(k_len), start, count)


def tnd_pieces(q_len, k_len, rows, right, cp, rank, order, name):
    """The pieces of a rank holding tokens ``rows = [t0, t1)`` of a TND batch of sequences of
    ``q_len[b]`` query tokens and ``k_len[b]`` keys (or, in head-tail order, two chunks of
    every sequence, each cut into ``2 cp`` chunks; ``name`` is the query lengths' argument,
    named when a sequence cannot be cut so)."""
    q_starts = _starts(q_len)
    if order is None:
        t0, t1 = rows
        spans = []
        for qs, n in zip(q_starts, q_len, strict=True):
            lo, hi = max(qs, t0), min(qs + n, t1)
            spans.append((lo - qs, hi - qs) if hi > lo else (0, 0))
        return [_tnd_piece(slice(None), spans, q_len, k_len, right)]
    parts = 2 * cp
    for b, n in enumerate(q_len):
        if n % parts:
            raise ValueError(
                f"{name}: sequence {b} has {n} query tokens, not a multiple of 2 * cp = {parts}, "
                "as head-tail order needs"
            )
    pieces = []
    for half, c in enumerate(chunk_pair(rank, cp, order)):
        index, offset, spans = [], 0, []
        for n in q_len:
            chunk = n // parts
            index.append(torch.arange(offset + half * chunk, offset + (half + 1) * chunk))
            offset += 2 * chunk
            spans.append((c * chunk, (c + 1) * chunk))
        index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
        pieces.append(_tnd_piece(index, spans, q_len, k_len, right))
    return pieces


def _tnd_piece(rows, spans, q_len, k_len, right):
    """A TND piece whose rows are, per sequence, its rows [lo, hi): each sequence keeps the keys
    those rows can see (none when it has no rows)."""
    q_used, k_used = [], []
    for (lo, hi), ql, kl in zip(spans, q_len, k_len, strict=True):
        q_used.append(hi - lo)
        k_used.append(keys_seen(hi, ql, kl, right) if hi > lo else 0)
    return Piece(rows, q_used, k_used, list(k_len))


def _starts(lengths):
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def kept_keys(piece, k_len):
    """TND: the indices, in the whole key tensor, of the keys a piece keeps (each sequence's
    leading ``k_used``)."""
    return torch.cat(
        [torch.arange(s, s + used) for s, used in zip(_starts(k_len), piece.k_used, strict=True)]
        or [torch.zeros(0, dtype=torch.long)]
    )


def join_rows(parts, pieces, dim):
    """The pieces' query-side outputs (``dim``: their row dim) as one output in the rank's row
    order."""
    if len(parts) == 1 and isinstance(pieces[0].rows, slice):
        return parts[0]
    out = torch.cat(parts, dim=dim)
    if isinstance(pieces[0].rows, slice):
        return out
    order = torch.argsort(torch.cat([p.rows for p in pieces]))
    return out.index_select(dim, order)
