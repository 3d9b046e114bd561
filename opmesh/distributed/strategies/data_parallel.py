"""Data parallel: batch slices, and TND shards that hold whole sequences."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def shard_ranges(total: int, shards: int) -> list[tuple[int, int]]:
    """[start, end) of each shard of a dim of ``total`` split ``shards`` ways over one mesh axis
    (DTensor's split: chunks of ceil(total / shards), the last ones short or empty)."""
    chunk = ceil_div(total, shards) if shards else 0
    return [(min(total, i * chunk), min(total, (i + 1) * chunk)) for i in range(shards)]


def shard_sizes(total: int, shards: int) -> list[int]:
    """Each shard's size of a dim of ``total`` split ``shards`` ways (DTensor's split)."""
    return [hi - lo for lo, hi in shard_ranges(total, shards)]


def whole_sequence_shards(cu_q, cu_k, q_layout, k_layout, dim: int = 0):
    """For TND with the query and key tokens (dim ``dim``) sharded alike over one mesh axis:
    per shard, the run of sequences [lo, hi) whose query tokens are exactly the shard's and
    whose key tokens are exactly the key shard's; None if some shard cuts a sequence, the
    cumulative lengths ``cu_q`` / ``cu_k`` (lists starting at 0) are missing or do not match
    the tensors (the operator's own checks report that)."""
    if cu_q is None or cu_k is None or len(q_layout.tensor_map[dim]) != 1:
        return None
    if len(cu_q) != len(cu_k) or cu_q[-1] != q_layout.shape[dim] or cu_k[-1] != k_layout.shape[dim]:
        return None
    shards = q_layout.num_shards(dim)
    q_ranges = shard_ranges(q_layout.shape[dim], shards)
    k_ranges = shard_ranges(k_layout.shape[dim], shards)
    if q_ranges[q_layout.shard_index(dim)] != q_layout.shard_range(dim):
        return None  # a split this rule does not know: take the general path
    bounds = list(zip(cu_q, cu_k, strict=True))
    runs = []
    for (q0, q1), (k0, k1) in zip(q_ranges, k_ranges, strict=True):
        starts = [b for b, pair in enumerate(bounds) if pair == (q0, k0)]
        ends = [b for b, pair in enumerate(bounds) if pair == (q1, k1)]
        if not starts or not ends or ends[-1] < starts[0]:
            return None
        runs.append((starts[0], ends[-1]))
    return runs
