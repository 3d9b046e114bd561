"""The all-to-all exchange of Ulysses context parallel, differentiable.

Each of a group's n ranks holds a tensor whose ``split_dim`` it cuts into n pieces (piece j goes
to rank j) and receives one piece from every rank, joined along ``cat_dim`` in rank order.
With the sequence as ``cat_dim`` and the heads as ``split_dim`` a sequence-sharded tensor
becomes a head-sharded full sequence; the reverse exchange (dims and sizes swapped) undoes it
and is its backward. Piece sizes may be uneven (DTensor's split of sequences and heads that do
not divide the group): every rank knows them all, so nothing but the data travels. One
``all_to_all_single`` call per exchange: each rank sends (n - 1) / n of its tensor, where an
all-gather would send all of it to every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _exchange(x, group, position, split_dim, cat_dim, split_sizes, cat_sizes):
    pieces = x.split(list(split_sizes), dim=split_dim)
    send = torch.cat([p.contiguous().reshape(-1) for p in pieces]) if pieces else x.reshape(-1)
    shapes = []
    for size in cat_sizes:
        shape = list(x.shape)
        shape[split_dim] = split_sizes[position]
        shape[cat_dim] = size
        shapes.append(shape)
    out_counts = [math.prod(s) for s in shapes]
    received = torch.empty(sum(out_counts), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(received, send, out_counts, [p.numel() for p in pieces], group=group)
    parts = [
        chunk.view(shape) for chunk, shape in zip(received.split(out_counts), shapes, strict=True)
    ]
    return torch.cat(parts, dim=cat_dim)


class AllToAll(torch.autograd.Function):
    """``AllToAll.apply(x, group, position, split_dim, cat_dim, split_sizes, cat_sizes)``:
    ``split_sizes[j]`` is the size of ``split_dim`` piece j (sent to group rank j),
    ``cat_sizes[i]`` the size along ``cat_dim`` of what rank i holds (its piece arrives
    there); ``position`` is this rank's place in the group."""

    @staticmethod
    def forward(ctx, x, group, position, split_dim, cat_dim, split_sizes, cat_sizes):
        ctx.args = (group, position, split_dim, cat_dim, split_sizes, cat_sizes)
        return _exchange(x, group, position, split_dim, cat_dim, split_sizes, cat_sizes)

    @staticmethod
    def backward(ctx, grad):
        group, position, split_dim, cat_dim, split_sizes, cat_sizes = ctx.args
        back = _exchange(
            grad.contiguous(), group, position, cat_dim, split_dim, cat_sizes, split_sizes
        )
        return back, None, None, None, None, None, None
