"""flash_attn on DTensors: data, head and context parallel (all-gather of keys and values).

Layouts BSND ``[B, S, N, D]`` and BNSD ``[B, N, S, D]`` for q, k and v, and TND ``[T, N, D]``
with the global cu_seqlens as plain tensors (heads, and q's tokens for context parallel by
all-gather in sequence order; paged caches are refused). Per mesh axis, each of q, k, v may
shard:

* the batch dim (data parallel): q, k and v alike;
* the head dim (tensor parallel): q, k and v alike, over one mesh axis, and only where every
  rank's query heads are exactly the query heads of its key heads (a split that would cut a
  GQA group is refused); sinks are replicated or sharded with the query heads;
* q's sequence dim (context parallel), over one mesh axis: k and v are replicated on that axis
  or sharded along their sequence dim on it, in which case they are all-gathered (DTensor's
  redistribute, whose backward reduce-scatters their gradients). Each rank's query rows
  [start, start + L) keep their global key range: the local call's ``seqused_kv`` is
  ``start + L + S2 - S1``, so the bottom-right diagonal stays where the global call has it.
  Masks 0, 3 and 4 (any window; in TND with ``win_right=0``, a causal sliding window).
  Head-tail order (context_parallel.py) in every layout; for TND every sequence is cut into
  2 * cp chunks.

D is never sharded, no input may be Partial. Without context parallel, ``metadata`` is each
rank's plan of its local problem (its batch slice and heads), made with flash_attn_metadata
there. The outputs take q's sharding: attn_out's batch, sequence and head dims follow q's, the
lse ``[B, Nq, S1]`` likewise. Gradients flow through the DTensor conversions and the operator's
own backward, so they come back with the inputs' placements.
"""

from __future__ import annotations

from ... import platform as _platform
from ..._bounded_cache import BoundedCache
from ..context_parallel import chunk_pair, from_head_tail, head_tail_order
from ..distributed_op import DistributedOp
from ..layout import Layout

NAMES = ("q", "k", "v")
# (batch, sequence, heads, head dim) positions per layout; TND has no batch dim.
DIMS = {"BSND": (0, 1, 2, 3), "BNSD": (0, 2, 1, 3), "TND": (None, 0, 1, 2)}


def _ceil_div(a, b):
    return -(-a // b)


class FlashAttnDistributedOp(DistributedOp):
    def __init__(self, op_name: str = "flash_attn"):
        super().__init__(op_name)
        self._checked = BoundedCache()

    def preprocess(self, args, kwargs):
        p = _platform.current()
        if len(args) != 3:
            raise ValueError(
                f"flash_attn: expected q, k and v as positional arguments, got {len(args)}"
            )
        for name, x in zip(NAMES, args, strict=True):
            if not p.is_dtensor(x):
                raise ValueError(
                    f"{name}: expected a DTensor like the other inputs, got {type(x).__name__}"
                )
        layout_q = kwargs.get("layout_q", "BSND")
        for name in ("layout_q", "layout_kv"):
            value = kwargs.get(name, "BSND")
            if value not in DIMS or value != layout_q:
                raise ValueError(
                    f"{name}: on a mesh q, k and v must share layout BSND, BNSD or TND, got "
                    f"{value!r}"
                )
        if kwargs.get("layout_out", "BSND") not in DIMS:
            raise ValueError(
                f"layout_out: expected 'BSND', 'BNSD' or 'TND' on a mesh, got "
                f"{kwargs['layout_out']!r}"
            )
        if kwargs.get("block_table") is not None:
            raise ValueError("block_table: paged caches are not supported with DTensor inputs")
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            if p.is_dtensor(kwargs.get(name)):
                raise ValueError(f"{name}: pass the global lengths as a plain tensor")
        layouts = [Layout.of(x) for x in args]
        mesh = layouts[0].mesh
        for name, lay in zip(NAMES, layouts, strict=True):
            if lay.mesh != mesh:
                raise ValueError(f"{name}: must be on the same device mesh as q")
            rank = 3 if layout_q == "TND" else 4
            if lay.ndim != rank:
                raise ValueError(
                    f"{name}: expected a {rank}-D DTensor ({layout_q}), got {lay.ndim}-D"
                )
            partial = lay.partial_axes()
            if partial:
                raise ValueError(
                    f"{name}: Partial placement on mesh axis {lay.axis_names[partial[0]]!r} is "
                    "not supported; reduce it (redistribute to Replicate or Shard) first"
                )
        b, s, n, d = DIMS[layout_q]
        qm, km, vm = (lay.tensor_map for lay in layouts)
        mode = kwargs.get("mask_mode", 0)

        def fail(name, lay, dim, why):
            raise ValueError(
                f"{name}: dim {dim} is sharded over mesh axes {lay.axes_text(dim)}; {why}"
            )

        for name, lay, tm in zip(NAMES, layouts, (qm, km, vm), strict=True):
            if tm[d]:
                fail(name, lay, d, "the head dim D must be replicated")
        for name, lay, tm in zip(NAMES[1:], layouts[1:], (km, vm), strict=True):
            if b is not None and tm[b] != qm[b]:
                fail(
                    name,
                    lay,
                    b,
                    f"the batch dim must be sharded as q's ({layouts[0].axes_text(b)})",
                )
            if tm[n] != qm[n]:
                fail(
                    name, lay, n, f"the head dim must be sharded as q's ({layouts[0].axes_text(n)})"
                )
        if qm[n]:
            if len(qm[n]) > 1:
                fail("q", layouts[0], n, "heads may be sharded over one mesh axis only")
            shards = layouts[0].num_shards(n)
            nq, nkv = layouts[0].shape[n], layouts[1].shape[n]
            group = nq // nkv if nkv and nq % nkv == 0 else 0
            if group == 0 or _ceil_div(nq, shards) != group * _ceil_div(nkv, shards):
                fail(
                    "q",
                    layouts[0],
                    n,
                    f"splitting {nq} query heads and {nkv} key heads {shards} ways would cut a "
                    "group of query heads from its key head",
                )
        args = list(args)
        kwargs = dict(kwargs)
        strategy = kwargs.pop("context_parallel", "all_gather")
        order = head_tail_order()
        if order is not None and not qm[s]:
            raise ValueError(
                "head_tail_cp: needs q's sequence sharded for context parallelism (over one "
                "mesh axis)"
            )
        if order is not None:
            cp = layouts[0].num_shards(s)
            for name, lay, tm in zip(NAMES, layouts, (qm, km, vm), strict=True):
                if (name == "q" or tm[s]) and lay.shape[s] % (2 * cp) != 0:
                    raise ValueError(
                        f"{name}: dim {s} has size {lay.shape[s]}, not a multiple of 2 * cp = "
                        f"{2 * cp}, as head_tail_cp needs"
                    )
        # TND data parallel: q's and k/v's tokens sharded alike, every shard holding whole
        # sequences in both; each rank then attends its own sequences, nothing is gathered.
        runs = (
            _whole_sequence_shards(kwargs, layouts[0], layouts[1])
            if layout_q == "TND"
            and bool(qm[s])
            and km[s] == qm[s] == vm[s]
            and strategy == "all_gather"
            and order is None
            else None
        )
        tnd_dp = runs is not None
        if qm[s] and not tnd_dp and kwargs.get("metadata") is not None:
            raise ValueError(
                "metadata: not supported with the query sequence sharded (the local calls' key "
                "ranges are set inside the op); without context parallel, pass each rank's plan "
                "of its local problem"
            )
        if tnd_dp:
            strategy = "tnd_data_parallel"
            kwargs = _rebased_lengths(kwargs, *runs[layouts[0].shard_index(s)])
        elif qm[s]:
            if len(qm[s]) > 1:
                fail(
                    "q", layouts[0], s, "the query sequence may be sharded over one mesh axis only"
                )
            if layout_q == "TND" and mode == 4 and kwargs.get("win_right", -1) != 0:
                raise ValueError(
                    "win_right: TND context parallel supports windows with win_right=0 (causal "
                    "sliding windows); BSND and BNSD take any window"
                )
            for name in ("seqused_q", "seqused_kv"):
                if kwargs.get(name) is not None:
                    raise ValueError(f"{name}: not supported with the query sequence sharded")
            if layout_q == "TND" and strategy == "ring":
                raise ValueError(
                    "layout_q: TND context parallel uses the all-gather strategy (in sequence or "
                    "head-tail order), not the ring"
                )
            if strategy == "ring":
                self._check_ring(layouts, qm, km, vm, s, mode, order)
            for i, (name, lay, tm) in enumerate(zip(NAMES[1:], layouts[1:], (km, vm), strict=True)):
                if tm[s] and tm[s] != qm[s]:
                    fail(
                        name,
                        lay,
                        s,
                        "the key sequence must be replicated or sharded as q's "
                        f"({layouts[0].axes_text(s)})",
                    )
                if tm[s] and strategy == "all_gather":
                    # All-gather keys and values over the context-parallel axis (differentiable).
                    placements = list(p.placements_of(args[i + 1]))
                    placements[qm[s][0]] = p.replicate()
                    args[i + 1] = p.redistribute(args[i + 1], mesh, tuple(placements))
        else:
            for name, lay, tm in zip(NAMES[1:], layouts[1:], (km, vm), strict=True):
                if tm[s]:
                    fail(name, lay, s, "the key sequence may be sharded only when q's is")
        # Where q's rows (batch or sequence) are split over a mesh axis on which an input is
        # replicated, each rank's gradient of that input is a partial sum: say so, and DTensor
        # sums it (and reduce-scatters it back for gathered keys and values).
        # Replicated sinks are also sliced to the rank's query heads, so their gradient is a
        # partial sum over the head axis too.
        row_axes = (set(qm[b]) if b is not None else set()) | set(qm[s])

        def grad_placements(x, axes=row_axes):
            return tuple(
                p.partial() if axis in axes and p.shard_dim(pl) is None else pl
                for axis, pl in enumerate(p.placements_of(x))
            )

        sinks = kwargs.get("sinks")
        kwargs = dict(kwargs)
        if p.is_dtensor(sinks):
            sl = Layout.of(sinks)
            if sl.tensor_map[0] not in ((), qm[n]):
                fail(
                    "sinks",
                    sl,
                    0,
                    f"sinks must be replicated or sharded as q's heads ({layouts[0].axes_text(n)})",
                )
            kwargs["sinks"] = p.to_local(sinks, grad_placements(sinks, row_axes | set(qm[n])))
            sinks_sharded = bool(sl.tensor_map[0])
        else:
            sinks_sharded = False
        local_args = (p.to_local(args[0]),) + tuple(
            p.to_local(x, grad_placements(x)) for x in args[1:]
        )
        cache_values = (
            layout_q,
            kwargs.get("layout_out", "BSND"),
            mesh,
            tuple(lay.placements for lay in layouts),
            tuple(lay.shape for lay in layouts),
            tuple(Layout.of(a).placements for a in args[1:]),
            bool(kwargs.get("return_softmax_lse", False)),
            sinks is not None and not sinks_sharded,
            order,
            strategy if qm[s] else "all_gather",
        )
        return local_args, kwargs, cache_values

    @staticmethod
    def _check_ring(layouts, qm, km, vm, s, mode, order):
        if mode not in (0, 3):
            raise ValueError(
                f"mask_mode: the ring strategy supports masks 0 and 3, got {mode}; use "
                "context_parallel='all_gather' for windows"
            )
        for name, lay, tm in zip(NAMES[1:], layouts[1:], (km, vm), strict=True):
            if tm[s] != qm[s]:
                raise ValueError(
                    f"{name}: dim {s} is sharded over mesh axes {lay.axes_text(s)}; the ring "
                    f"strategy needs it sharded as q's ({layouts[0].axes_text(s)})"
                )
        if mode == 3 and layouts[0].shape[s] != layouts[1].shape[s]:
            raise ValueError(
                f"k: the ring strategy with a causal mask needs as many keys as queries, got "
                f"{layouts[1].shape[s]} and {layouts[0].shape[s]}"
            )
        if order is not None:
            raise ValueError(
                "head_tail_cp: the ring strategy takes contiguous shards; use "
                "context_parallel='all_gather' with head-tail order"
            )

    def infer_layout(self, cache_values):
        layout_q, layout_out, mesh, placements, shapes, _kv, return_lse, _s, _o, _c = cache_values
        p = _platform.current()
        b, s, n, _d = DIMS[layout_q]
        ob, os_, on, _ = DIMS[layout_out]
        q_shape, v_shape = shapes[0], shapes[2]
        out, lse = [], []
        if layout_q == "TND":
            # out [T1, N, Dv] and lse [N, T1] take T1 and the heads from q.
            for placement in placements[0]:
                dim = p.shard_dim(placement)
                target = {s: (0, 1), n: (1, 0)}.get(dim)
                out.append(p.shard(target[0]) if target else p.replicate())
                lse.append(p.shard(target[1]) if target else p.replicate())
            out_spec = (mesh, tuple(out), (q_shape[s], q_shape[n], v_shape[2]))
            if return_lse:
                lse_spec = (mesh, tuple(lse), (q_shape[n], q_shape[s]))
            else:
                lse_spec = (mesh, tuple(p.replicate() for _ in placements[0]), (0,))
            return (out_spec, lse_spec), None
        for placement in placements[0]:
            dim = p.shard_dim(placement)
            target = {b: (ob, 0), s: (os_, 2), n: (on, 1)}.get(dim)
            out.append(p.shard(target[0]) if target else p.replicate())
            lse.append(p.shard(target[1]) if target else p.replicate())
        out_shape = [0, 0, 0, 0]
        out_shape[ob], out_shape[os_], out_shape[on] = q_shape[b], q_shape[s], q_shape[n]
        out_shape[3] = v_shape[3]
        out_spec = (mesh, tuple(out), tuple(out_shape))
        if return_lse:
            lse_spec = (mesh, tuple(lse), (q_shape[b], q_shape[n], q_shape[s]))
        else:
            lse_spec = (mesh, tuple(p.replicate() for _ in placements[0]), (0,))
        return (out_spec, lse_spec), None

    def get_expand_impl(self, func, infer_result, cache_values):
        layout_q, layout_out, mesh, placements, shapes, _kv, _lse, slice_sinks, order, strategy = (
            cache_values
        )
        q_layout = Layout(mesh, placements[0], shapes[0])
        if strategy == "ring":
            return _RingLocal(func, layout_q, layout_out, q_layout, shapes[1], slice_sinks)
        if strategy == "tnd_data_parallel":
            # The lengths were rebased to this rank's sequences in preprocess.
            if not slice_sinks:
                return None
            heads = q_layout.shard_range(DIMS[layout_q][2])
            return lambda q, k, v, **kw: func(
                q, k, v, **dict(kw, sinks=_head_slice(kw.get("sinks"), heads))
            )
        # Keys and values sharded along their sequence arrive gathered in head-tail order.
        kv_gathered = bool(Layout(mesh, placements[1], shapes[1]).tensor_map[DIMS[layout_q][1]])
        return _Local(
            func, layout_q, layout_out, q_layout, shapes[1], slice_sinks, order, kv_gathered
        )


class _Local:
    """The local call: the batch slice of the lengths, the head slice of replicated sinks, and
    for context parallel the key range each rank's query rows keep (per chunk in head-tail
    order, whose two chunks are computed apart and joined)."""

    def __init__(self, func, layout, layout_out, q_layout, k_shape, slice_sinks, order, gathered):
        b, s, n, _ = DIMS[layout]
        self.func = func
        self.tnd = layout == "TND"
        self.s_dim, self.out_s_dim = s, DIMS[layout_out][1]
        self.batch = q_layout.shard_range(b) if b is not None else (0, 0)
        self.heads = q_layout.shard_range(n)
        self.rows = q_layout.shard_range(s)
        self.cp = bool(q_layout.tensor_map[s])
        self.cp_size = q_layout.num_shards(s)
        self.rank = q_layout.shard_index(s)
        self.s1, self.s2 = q_layout.shape[s], k_shape[s]
        self.slice_sinks = slice_sinks
        self.order = order
        self.gathered = gathered

    def _tnd_slice(self, kwargs):
        import torch

        cu_q = [int(x) for x in kwargs["cu_seqlens_q"].tolist()]
        cu_k = [int(x) for x in kwargs["cu_seqlens_kv"].tolist()]
        if cu_q[-1] != self.s1:
            raise ValueError(
                f"cu_seqlens_q: last entry {cu_q[-1]} must equal the query token count {self.s1}"
            )
        local, used = _tnd_slice_lengths(cu_q, cu_k, *self.rows, kwargs.get("mask_mode", 0))
        kwargs = dict(kwargs)
        kwargs["cu_seqlens_q"] = torch.tensor(local, dtype=torch.int32)
        kwargs["seqused_kv"] = torch.tensor(used, dtype=torch.int32)
        kwargs["max_seqlen_q"] = kwargs["max_seqlen_kv"] = None
        return kwargs

    def _tnd_head_tail(self, q, k, v, kwargs):
        """TND in head-tail order: the rank's rows are, sequence by sequence, its two chunks of
        that sequence. One call takes every sequence's first chunk, another every second chunk,
        each with the sequence's keys up to the chunk's diagonal; the rows are put back in the
        local order."""
        import torch

        cu_q = [int(x) for x in kwargs["cu_seqlens_q"].tolist()]
        cu_k = [int(x) for x in kwargs["cu_seqlens_kv"].tolist()]
        if cu_q[-1] != self.s1:
            raise ValueError(
                f"cu_seqlens_q: last entry {cu_q[-1]} must equal the query token count {self.s1}"
            )
        parts = 2 * self.cp_size
        for b in range(len(cu_q) - 1):
            if (cu_q[b + 1] - cu_q[b]) % parts:
                raise ValueError(
                    f"cu_seqlens_q: sequence {b} has {cu_q[b + 1] - cu_q[b]} query tokens, not a "
                    f"multiple of 2 * cp = {parts}, as head-tail order needs"
                )
        if self.gathered:
            k = from_head_tail(k, 0, self.cp_size, self.order, cu_seqlens=cu_k)
            v = from_head_tail(v, 0, self.cp_size, self.order, cu_seqlens=cu_k)
        mode = kwargs.get("mask_mode", 0)
        pair = chunk_pair(self.rank, self.cp_size, self.order)
        lengths = [(cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]) for b in range(len(cu_q) - 1)]
        rows, local, halves = [], 0, [[], []]
        for q_len, _ in lengths:
            chunk = q_len // parts
            for half in range(2):
                halves[half].append(torch.arange(local, local + chunk))
                local += chunk
        outs, lses = [], []
        for half, chunk_index in enumerate(pair):
            index = torch.cat(halves[half]) if halves[half] else torch.zeros(0, dtype=torch.long)
            rows.append(index)
            chunks = [q_len // parts for q_len, _ in lengths]
            used = [
                k_len if mode == 0 else max(0, min(k_len, (chunk_index + 1) * c + k_len - q_len))
                for (q_len, k_len), c in zip(lengths, chunks, strict=True)
            ]
            call = dict(kwargs)
            call["cu_seqlens_q"] = torch.tensor([0, *_cumsum(chunks)], dtype=torch.int32)
            call["seqused_kv"] = torch.tensor(used, dtype=torch.int32)
            call["max_seqlen_q"] = call["max_seqlen_kv"] = None
            out, lse = self.func(q.index_select(0, index), k, v, **call)
            outs.append(out)
            lses.append(lse)
        order = torch.argsort(torch.cat(rows))
        out = torch.cat(outs).index_select(0, order)
        if lses[0].numel() == 0 and lses[1].numel() == 0:
            return out, lses[0]
        return out, torch.cat(lses, dim=1).index_select(1, order)

    def __call__(self, q, k, v, **kwargs):
        import torch

        b0, b1 = self.batch
        if not self.tnd:
            for name in ("seqused_q", "seqused_kv"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][b0:b1]
        if self.slice_sinks:
            kwargs["sinks"] = _head_slice(kwargs.get("sinks"), self.heads)
        if self.tnd and self.cp and self.order is not None:
            return self._tnd_head_tail(q, k, v, kwargs)
        if self.tnd and self.cp:
            return self.func(q, k, v, **self._tnd_slice(kwargs))
        if not self.cp or kwargs.get("mask_mode", 0) == 0:
            if self.order is not None and self.gathered:
                k = from_head_tail(k, self.s_dim, self.cp_size, self.order)
                v = from_head_tail(v, self.s_dim, self.cp_size, self.order)
            return self.func(q, k, v, **kwargs)

        def band(start, rows):
            return dict(kwargs, **_local_band(start, rows, self.s1, self.s2, b1 - b0, kwargs))

        if self.order is None:
            return self.func(q, k, v, **band(self.rows[0], self.rows[1] - self.rows[0]))
        if self.gathered:
            k = from_head_tail(k, self.s_dim, self.cp_size, self.order)
            v = from_head_tail(v, self.s_dim, self.cp_size, self.order)
        chunk = self.s1 // (2 * self.cp_size)
        halves = []
        for half, c in enumerate(chunk_pair(self.rank, self.cp_size, self.order)):
            rows = q.narrow(self.s_dim, half * chunk, chunk)
            halves.append(self.func(rows, k, v, **band(c * chunk, chunk)))
        out = torch.cat([h[0] for h in halves], dim=self.out_s_dim)
        lse = (
            halves[0][1] if halves[0][1].numel() == 0 else torch.cat([h[1] for h in halves], dim=2)
        )
        return out, lse


def _cumsum(values):
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _shard_ranges(total, shards):
    """[start, end) of each shard of a dim of ``total`` split ``shards`` ways over one mesh axis
    (DTensor's split: chunks of ceil(total / shards), the last ones short or empty)."""
    chunk = _ceil_div(total, shards) if shards else 0
    return [(min(total, i * chunk), min(total, (i + 1) * chunk)) for i in range(shards)]


def _whole_sequence_shards(kwargs, q_layout, k_layout):
    """For TND with q's and k's tokens sharded alike over one mesh axis: per shard, the run of
    sequences [lo, hi) whose query tokens are exactly the shard's and whose key tokens are
    exactly the k shard's; None if some shard cuts a sequence (or the lengths are missing)."""
    cu_q, cu_k = kwargs.get("cu_seqlens_q"), kwargs.get("cu_seqlens_kv")
    if cu_q is None or cu_k is None or len(q_layout.tensor_map[0]) != 1:
        return None
    cu_q = [int(x) for x in cu_q.tolist()]
    cu_k = [int(x) for x in cu_k.tolist()]
    if len(cu_q) != len(cu_k) or cu_q[-1] != q_layout.shape[0] or cu_k[-1] != k_layout.shape[0]:
        return None  # the operator's own checks report it
    shards = q_layout.num_shards(0)
    q_ranges = _shard_ranges(q_layout.shape[0], shards)
    k_ranges = _shard_ranges(k_layout.shape[0], shards)
    if q_ranges[q_layout.shard_index(0)] != q_layout.shard_range(0):
        return None  # a split this rule does not know: take the general path
    runs = []
    for (q0, q1), (k0, k1) in zip(q_ranges, k_ranges, strict=True):
        starts = [b for b, (a, c) in enumerate(zip(cu_q, cu_k, strict=True)) if (a, c) == (q0, k0)]
        ends = [b for b, (a, c) in enumerate(zip(cu_q, cu_k, strict=True)) if (a, c) == (q1, k1)]
        if not starts or not ends or ends[-1] < starts[0]:
            return None
        runs.append((starts[0], ends[-1]))
    return runs


def _rebased_lengths(kwargs, lo, hi):
    """TND data parallel: the call's lengths for the rank's whole sequences [lo, hi), rebased to
    its shards."""
    import torch

    kwargs = dict(kwargs)
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        cu = kwargs[name][lo : hi + 1].to(torch.int32)
        # A shard without sequences runs one empty sequence.
        kwargs[name] = cu - cu[0] if hi > lo else torch.zeros(2, dtype=torch.int32)
    for name in ("seqused_q", "seqused_kv"):
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][lo:hi] if hi > lo else torch.zeros(1, dtype=torch.int32)
    if kwargs.get("metadata") is None:
        kwargs["max_seqlen_q"] = kwargs["max_seqlen_kv"] = None
    return kwargs


def _head_slice(sinks, heads):
    return sinks if sinks is None else sinks[heads[0] : heads[1]]


def _local_band(start, rows, s1, s2, batch, kwargs):
    """The local call's key count and window for global query rows [start, start + rows) of
    S1 against all S2 keys, so that every row sees exactly the keys it sees in the global call.

    The mask's diagonal is bottom-right aligned: global row i sits at key i + S2 - S1, local
    row i - start at i - start + u - rows for ``u = seqused_kv``. Cutting the keys at the last
    row's diagonal plus its right window (u = start + rows + S2 - S1 + win_right, at most S2)
    keeps every key a row can see; the local diagonal then lies ``shift = u - (start + rows +
    S2 - S1)`` keys to the right of the global one, which the window's sides absorb (left side
    wider, right side narrower by ``shift``, never below 0)."""
    import torch

    mode = kwargs.get("mask_mode", 0)
    left, right = kwargs.get("win_left", -1), kwargs.get("win_right", -1)
    if mode == 3:
        left, right = -1, 0
    diagonal_end = start + rows + s2 - s1
    used = s2 if right < 0 else max(0, min(s2, diagonal_end + right))
    out = {"seqused_kv": torch.full((batch,), used, dtype=torch.int32)}
    shift = used - diagonal_end
    if mode == 4 and used > 0 and shift:
        out["win_left"] = -1 if left < 0 else left + shift
        out["win_right"] = -1 if right < 0 else right - shift
    return out


def _tnd_slice_lengths(cu_q, cu_k, t0, t1, mode):
    """For the rank's query tokens [t0, t1) of a TND batch: the local cu_seqlens_q, and per
    sequence the keys its local rows see (seqused_kv against the whole key tensor), so every
    row keeps its global key range and bottom-right diagonal."""
    local = [0]
    used = []
    for b in range(len(cu_q) - 1):
        qs, qe = cu_q[b], cu_q[b + 1]
        lo, hi = max(qs, t0), min(qe, t1)
        rows = max(0, hi - lo)
        local.append(local[-1] + rows)
        k_len = cu_k[b + 1] - cu_k[b]
        if mode == 0:
            used.append(k_len)
        else:
            # The last local row is row hi - qs - 1 of the sequence; with `rows` rows in use
            # the diagonal sits where the global call has it.
            used.append(max(0, min(k_len, (hi - qs) + k_len - (qe - qs))) if rows else 0)
    return local, used


class _RingLocal:
    """The ring strategy's local call (opmesh/distributed/ring.py)."""

    def __init__(self, func, layout, layout_out, q_layout, k_shape, slice_sinks):
        from ..ring import RingGroup

        b, s, n, _ = DIMS[layout]
        p = _platform.current()
        axis = q_layout.tensor_map[s][0]
        size = p.mesh_shape(q_layout.mesh)[axis]
        total = k_shape[s]  # the chunks that travel are the keys'
        chunk = _ceil_div(total, size)
        lengths = [max(0, min(total, (i + 1) * chunk) - i * chunk) for i in range(size)]
        self.ring = RingGroup(
            p.axis_group(q_layout.mesh, axis), p.mesh_coordinate(q_layout.mesh)[axis], size, lengths
        )
        self.layout, self.layout_out = layout, layout_out
        self.batch = q_layout.shard_range(b)
        self.heads = q_layout.shard_range(n)
        self.slice_sinks = slice_sinks

    def __call__(self, q, k, v, **kwargs):
        import torch

        from ..ring import RingAttention

        sinks = kwargs.get("sinks")
        if self.slice_sinks:
            sinks = _head_slice(sinks, self.heads)
        options = dict(
            layout_q=self.layout,
            layout_kv=self.layout,
            layout_out=self.layout_out,
            softmax_scale=kwargs.get("softmax_scale"),
        )
        out, lse = RingAttention.apply(
            q, k, v, sinks, self.ring, kwargs.get("mask_mode", 0) == 3, options
        )
        if not kwargs.get("return_softmax_lse", False):
            lse = torch.empty(0, device=q.device)
        return out, lse
