"""Head parallel: query heads split over ranks, with their key heads (grouped-query attention)."""

from __future__ import annotations

import torch

from .data_parallel import ceil_div


def keeps_gqa_groups(nq: int, nkv: int, shards: int) -> bool:
    """Whether splitting ``nq`` query heads and ``nkv`` key heads ``shards`` ways (DTensor's
    split: chunks of the ceiling) leaves every query head on its key head's rank."""
    if nkv == 0 or nq % nkv:
        return False
    return ceil_div(nq, shards) == (nq // nkv) * ceil_div(nkv, shards)


def kv_for_heads(kv, n, heads, nq, nkv):
    """From whole key and value tensors (every head), the heads query heads ``heads = [h0,
    h1)`` of ``nq`` use, laid out so that local query head i uses local key head
    ``i // (local query heads / local key heads)``: a slice when the query heads cover whole
    groups or lie in one group, else one key head per query head."""
    h0, h1 = heads
    group = nq // nkv
    if h1 <= h0:
        return tuple(x.narrow(n, 0, 0) for x in kv)
    if h0 % group == 0 and h1 % group == 0:
        return tuple(x.narrow(n, h0 // group, (h1 - h0) // group) for x in kv)
    if h0 // group == (h1 - 1) // group:
        return tuple(x.narrow(n, h0 // group, 1) for x in kv)
    index = torch.tensor([h // group for h in range(h0, h1)], device=kv[0].device)
    return tuple(x.index_select(n, index) for x in kv)


def kv_repeat(nq: int, nkv: int, shards: int) -> int:
    """How many times each key/value head is repeated so that ``nq`` query heads split
    ``shards`` ways keep their key heads: the smallest divisor of the group size that does
    (at most the group size, where every query head has its own copy)."""
    group = nq // nkv if nkv and nq % nkv == 0 else 1
    for repeat in range(1, group + 1):
        if group % repeat == 0 and keeps_gqa_groups(nq, nkv * repeat, shards):
            return repeat
    return group


def head_slice(x, heads, dim: int = -1):
    """The entries of a per-head argument (``None`` stays ``None``) for query heads
    ``heads = [h0, h1)`` along ``dim``."""
    if x is None:
        return x
    return x.narrow(dim % x.dim(), heads[0], heads[1] - heads[0])
