"""dense_lightning_indexer_softmax_lse on DTensors: layout rules and context parallelism.

BSND: q [B, S1, N1, D], k [B, S2, N2, D], w [B, S1, N1]. Heads and D must be replicated, and so
must k's S2. The batch dim is sharded alike in all three, and w's S1 like q's. The output
[B, N2, S1] takes B and S1 from q.
TND: q [T1, N1, D], k [T2, N2, D], w [T1, N1]. Only q's and w's T1 may be sharded, and alike.
The output [N2, T1] takes T1 from q.

Context parallel: when q's query sequence is sharded, each rank computes its own query rows
against the replicated keys. The lengths the kernel receives are rewritten so that each local
row keeps its global key range: it sees the key prefix its rows can see and no more. With
opmesh.head_tail_cp() the query shards are in head-tail order (context_parallel.py). A band
(pre_tokens / next_tokens) stays exact with sparse_mode=3, whose rewritten lengths keep every
row's diagonal; with sparse_mode=0 it is refused when the query sequence is sharded.
"""

from __future__ import annotations

import torch

from ... import platform as _platform
from ..._bounded_cache import BoundedCache
from ..._schema import MAX_TOKENS, UNBOUNDED, positional
from ..context_parallel import chunk_pair, head_tail_order
from ..distributed_op import DistributedOp
from ..layout import Layout

NAMES = positional("dense_lightning_indexer_softmax_lse")
# The indexer's layout table (its DistributedOp's rules and the raw operator's sharding
# strategies read it): the named dims of query_index, key_index and weights.
DIM_NAMES = {
    "BSND": (("B", "S1", "N1", "D"), ("B", "S2", "N2", "D"), ("B", "S1", "N1")),
    "TND": (("T1", "N1", "D"), ("T2", "N2", "D"), ("T1", "N1")),
}


RANKS = {layout: tuple(len(d) for d in dims) for layout, dims in DIM_NAMES.items()}
LENGTH_NAMES = ("actual_seq_qlen", "actual_seq_klen")


def local_lengths(kwargs, names=LENGTH_NAMES):
    """Length arguments given as DTensors must be replicated on every mesh axis: every rank
    reads the whole array. Returns kwargs with their local (full) tensors."""
    p = _platform.current()
    if not any(p.is_dtensor(kwargs.get(n)) for n in names):
        return kwargs
    kwargs = dict(kwargs)
    for name in names:
        value = kwargs.get(name)
        if not p.is_dtensor(value):
            continue
        if any(p.shard_dim(pl) is not None or p.is_partial(pl) for pl in p.placements_of(value)):
            raise ValueError(
                f"{name}: a DTensor of lengths must be replicated on every mesh axis, got "
                f"placements {tuple(p.placements_of(value))}"
            )
        kwargs[name] = p.to_local(value).detach()
    return kwargs


def _lengths_list(value):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.tolist()]
    return [int(v) for v in value]


def _as_tensor(value):
    return value if isinstance(value, torch.Tensor) else torch.tensor(list(value))


class IndexerDistributedOp(DistributedOp):
    def __init__(self, op_name: str = "dense_lightning_indexer_softmax_lse"):
        super().__init__(op_name)
        self._checked = BoundedCache()  # cache values whose layouts passed the rules

    # -- preprocess: check the layouts, take the DTensors apart -----------------------------

    def preprocess(self, args, kwargs):
        p = _platform.current()
        kwargs = local_lengths(kwargs)
        if len(args) == 3 and all(p.is_dtensor(x) for x in args):
            key = (
                kwargs.get("layout", "BSND"),
                kwargs.get("sparse_mode", 3),
                p.mesh_of(args[0]),
                tuple(p.placements_of(x) for x in args),
                tuple(p.global_shape(x) for x in args),
                head_tail_order(),
            )
            if self._checked.get(key):
                return tuple(p.to_local(x) for x in args), kwargs, key
        return self._check_and_take_apart(args, kwargs)

    def _check_and_take_apart(self, args, kwargs):
        p = _platform.current()
        if len(args) != 3:
            raise ValueError(
                "dense_lightning_indexer_softmax_lse: expected query_index, key_index and weights "
                f"as positional arguments, got {len(args)}"
            )
        layout = kwargs.get("layout", "BSND")
        if layout not in DIM_NAMES:
            raise ValueError(f"layout: expected 'BSND' or 'TND', got {layout!r}")
        for name, x in zip(NAMES, args, strict=True):
            if not p.is_dtensor(x):
                raise ValueError(
                    f"{name}: expected a DTensor like the other inputs, got {type(x).__name__}"
                )
        for name, x, rank, dims in zip(NAMES, args, RANKS[layout], DIM_NAMES[layout], strict=True):
            shape = p.global_shape(x)
            if len(shape) != rank:
                raise ValueError(
                    f"{name}: expected a {rank}-D DTensor [{', '.join(dims)}] for layout "
                    f"{layout}, got {len(shape)}-D with global shape {tuple(shape)}"
                )
        layouts = [Layout.of(x) for x in args]
        mesh = layouts[0].mesh
        for name, lay in zip(NAMES[1:], layouts[1:], strict=True):
            if lay.mesh != mesh:
                raise ValueError(f"{name}: must be on the same device mesh as query_index")
        for name, lay in zip(NAMES, layouts, strict=True):
            partial = lay.partial_axes()
            if partial:
                raise ValueError(
                    f"{name}: Partial placement on mesh axis {lay.axis_names[partial[0]]!r} is "
                    "not supported; reduce it (redistribute to Replicate or Shard) first"
                )
        self._check_rules(layout, layouts)
        head_tail = head_tail_order()
        q_map = layouts[0].tensor_map
        if head_tail and not (layout == "BSND" and q_map[1]):
            raise ValueError(
                "head_tail_cp: needs layout BSND with query_index's S1 sharded for context "
                "parallelism"
            )
        cp = q_map[1] if layout == "BSND" else q_map[0]
        if cp and kwargs.get("sparse_mode", 3) == 0:
            for name in ("pre_tokens", "next_tokens"):
                if kwargs.get(name, UNBOUNDED) < MAX_TOKENS:
                    raise ValueError(
                        f"{name}: a band with sparse_mode=0 cannot be split over the query "
                        "sequence (context parallel); use sparse_mode=3 or replicate the "
                        "query sequence"
                    )
        local_args = tuple(p.to_local(x) for x in args)
        cache_values = (
            layout,
            kwargs.get("sparse_mode", 3),
            mesh,
            tuple(lay.placements for lay in layouts),
            tuple(lay.shape for lay in layouts),
            head_tail,
        )
        self._checked.put(cache_values, True)
        return local_args, kwargs, cache_values

    @staticmethod
    def _check_rules(layout, layouts):
        dims = DIM_NAMES[layout]

        def fail(t, d, why):
            lay = layouts[t]
            where = (
                f"is sharded over mesh axis {lay.axes_text(d)}"
                if lay.tensor_map[d]
                else "is not sharded"
            )
            raise ValueError(f"{NAMES[t]}: dim {d} ({dims[t][d]}) {where}; {why}")

        maps = [lay.tensor_map for lay in layouts]
        replicated = (
            {0: (2, 3), 1: (1, 2, 3), 2: (2,)}
            if layout == "BSND"
            else {0: (1, 2), 1: (0, 1, 2), 2: (1,)}
        )
        for t, ds in replicated.items():
            for d in ds:
                if maps[t][d]:
                    why = (
                        "keys must be replicated (context parallel shards the queries only)"
                        if t == 1 and dims[t][d] in ("S2", "T2")
                        else "it must be replicated"
                    )
                    fail(t, d, why)
        if layout == "BSND":
            for t in (1, 2):
                if maps[t][0] != maps[0][0]:
                    fail(
                        t,
                        0,
                        f"the batch must be sharded like query_index's "
                        f"(mesh axis {layouts[0].axes_text(0)})",
                    )
            if maps[2][1] != maps[0][1]:
                fail(
                    2,
                    1,
                    f"S1 must be sharded like query_index's (mesh axis {layouts[0].axes_text(1)})",
                )
        elif maps[2][0] != maps[0][0]:
            fail(
                2, 0, f"T1 must be sharded like query_index's (mesh axis {layouts[0].axes_text(0)})"
            )

    # -- output layouts ---------------------------------------------------------------------

    def infer_layout(self, cache_values):
        layout, _mode, mesh, placements, shapes, _head_tail = cache_values
        p = _platform.current()
        out = []
        for placement in placements[0]:
            dim = p.shard_dim(placement)
            if layout == "BSND" and dim in (0, 1):
                out.append(p.shard(0 if dim == 0 else 2))
            elif layout == "TND" and dim == 0:
                out.append(p.shard(1))
            else:
                out.append(p.replicate())
        q_shape, k_shape = shapes[0], shapes[1]
        if layout == "BSND":
            global_shape = (q_shape[0], k_shape[2], q_shape[1])
        else:
            global_shape = (k_shape[1], q_shape[0])
        spec = (mesh, tuple(out), global_shape)
        return (spec, spec), None

    # -- the local call: batch slices of the lengths, and context parallel ------------------

    def get_expand_impl(self, func, infer_result, cache_values):
        layout, mode, mesh, placements, shapes, head_tail = cache_values
        q_layout = Layout(mesh, placements[0], shapes[0])
        if layout == "BSND":
            return _BsndLocal(func, q_layout, shapes[1][1], mode, head_tail)
        return _TndLocal(func, q_layout, shapes[1][0], mode)


class _BsndLocal:
    """The local call in BSND: the local batch's lengths and, for context parallel, lengths
    rewritten so each local row keeps its global key range (``pieces``)."""

    def __init__(self, func, q_layout, s2, mode, head_tail):
        self.func, self.mode, self.s2, self.head_tail = func, mode, s2, head_tail
        self.s1 = q_layout.shape[1]
        self.batch = q_layout.shard_range(0)
        self.rows = q_layout.shard_range(1)
        self.cp = q_layout.num_shards(1)
        self.rank = q_layout.shard_index(1)

    def pieces(self, actual_seq_qlen, actual_seq_klen):
        """``[(rows, qlen, klen, keys)]``: each piece of the local query rows (a slice along S1)
        with the lengths its call takes; ``keys`` is None (every key tensor row stays)."""
        b0, b1 = self.batch
        if self.cp == 1 and not self.head_tail:
            # No context parallel: the local call as it is, with the lengths of the local batch.
            def local(lengths):
                return lengths if lengths is None else _as_tensor(lengths)[b0:b1]

            return [(slice(None), local(actual_seq_qlen), local(actual_seq_klen), None)]
        qlen = _lengths_list(actual_seq_qlen)
        klen = _lengths_list(actual_seq_klen)
        qlen = [self.s1] * (b1 - b0) if qlen is None else qlen[b0:b1]
        klen = [self.s2] * (b1 - b0) if klen is None else klen[b0:b1]
        if not self.head_tail:
            rows = self.rows[1] - self.rows[0]
            return [(slice(None), *self._lengths(rows, qlen, klen, self.rows[0]), None)]
        chunk = self.s1 // (2 * self.cp)
        if self.s1 % (2 * self.cp) != 0:
            raise ValueError(
                f"query_index: S1={self.s1} is not a multiple of 2 * cp = {2 * self.cp}, as "
                "head_tail_cp needs"
            )
        pair = chunk_pair(self.rank, self.cp, self.head_tail)
        return [
            (slice(half * chunk, (half + 1) * chunk), *self._lengths(chunk, qlen, klen, c * chunk))
            + (None,)
            for half, c in enumerate(pair)
        ]

    def _lengths(self, rows, qlen, klen, start):
        """Local rows are global rows [start, start + rows) of each sequence."""
        q_used = [max(0, min(rows, n - start)) for n in qlen]
        if self.mode == 3:
            # Local row i is global row start + i: it keeps its keys j <= i + start + klen - qlen.
            k_used = [
                max(0, min(kl, kl - ql + start + qu))
                for ql, kl, qu in zip(qlen, klen, q_used, strict=True)
            ]
        else:
            k_used = list(klen)
        return torch.tensor(q_used, dtype=torch.int64), torch.tensor(k_used, dtype=torch.int64)

    def __call__(self, q, k, w, *, actual_seq_qlen=None, actual_seq_klen=None, **kwargs):
        outs = [
            self.func(q[:, rows], k, w[:, rows], actual_seq_qlen=ql, actual_seq_klen=kl, **kwargs)
            for rows, ql, kl, _keys in self.pieces(actual_seq_qlen, actual_seq_klen)
        ]
        if len(outs) == 1:
            return outs[0]
        return tuple(torch.cat(parts, dim=2) for parts in zip(*outs, strict=True))


class _TndLocal:
    """The local call in TND: the rank's query tokens with lengths rewritten so each keeps its
    global key range (``pieces``)."""

    def __init__(self, func, q_layout, t2, mode):
        self.func, self.mode, self.t2 = func, mode, t2
        self.tokens = q_layout.shard_range(0)

    def pieces(self, actual_seq_qlen, actual_seq_klen):
        """``[(rows, qlen, klen, keys)]`` with one piece: all local tokens, the cumulative local
        lengths, and how many key tokens the call keeps (None for all)."""
        q_ends = _lengths_list(actual_seq_qlen)
        k_ends = _lengths_list(actual_seq_klen)
        if q_ends is None or k_ends is None:
            raise ValueError("actual_seq_qlen, actual_seq_klen: required for layout TND")
        if len(q_ends) != len(k_ends):
            raise ValueError(
                f"actual_seq_klen: expected {len(q_ends)} entries like actual_seq_qlen, got "
                f"{len(k_ends)}"
            )
        t0, t1 = self.tokens
        q_used, k_used = [], []
        last = -1
        for b, (qe, ke) in enumerate(zip(q_ends, k_ends, strict=True)):
            qs = q_ends[b - 1] if b else 0
            ks = k_ends[b - 1] if b else 0
            lo, hi = max(qs, t0), min(qe, t1)
            used = max(0, hi - lo)
            q_len, k_len = qe - qs, ke - ks
            if used and self.mode == 3:
                # The local rows are rows lo - qs .. of this sequence; keep their key ranges.
                k_len_local = max(0, min(k_len, k_len - q_len + (lo - qs) + used))
            else:
                k_len_local = k_len
            if used:
                last = b
            q_used.append(used)
            k_used.append(k_len_local)
        # Only the last sequence with local rows may have lost keys; sequences after it have no
        # local rows, so the next one absorbs the difference to keep every key offset in place.
        deficit = (
            (k_ends[last] - (k_ends[last - 1] if last > 0 else 0)) - k_used[last]
            if last >= 0
            else 0
        )
        if deficit and last + 1 < len(k_used):
            k_used[last + 1] += deficit
            deficit = 0
        q_cum = torch.tensor(q_used, dtype=torch.int64).cumsum(0)
        k_cum = torch.tensor(k_used, dtype=torch.int64).cumsum(0)
        return [(slice(None), q_cum, k_cum, self.t2 - deficit if deficit else None)]

    def __call__(self, q, k, w, *, actual_seq_qlen=None, actual_seq_klen=None, **kwargs):
        ((_rows, q_cum, k_cum, keys),) = self.pieces(actual_seq_qlen, actual_seq_klen)
        keys_used = k if keys is None else k[:keys]
        return self.func(q, keys_used, w, actual_seq_qlen=q_cum, actual_seq_klen=k_cum, **kwargs)
