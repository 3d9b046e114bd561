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

``softcap`` works with every strategy (it changes each score alone). ``alibi_slopes`` (a plain
tensor or a replicated DTensor, ``[Nq]`` or ``[B, Nq]``) is cut to each rank's query heads and
batch entries; its bias needs each local call to keep the global diagonal, which data, head and
TND data parallel, Ulysses and the all-gather strategy with ``mask_mode=3`` do (the ring, the
two-axis hybrid and the all-gather strategy with other masks are refused by name).

D is never sharded, no input may be Partial. A quantized cache (``k_scale``, ``v_scale``) is
refused: it is read by the local operator on each rank's own tensors. Without context parallel,
``metadata`` is each rank's plan of its local problem (its batch slice and heads), made with
flash_attn_metadata there. The outputs take q's sharding: attn_out's batch, sequence and head dims
follow q's, the lse ``[B, Nq, S1]`` likewise. Gradients flow through the DTensor conversions and the
operator's own backward, so they come back with the inputs' placements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import platform as _platform
from ..._bounded_cache import BoundedCache
from ..context_parallel import head_tail_order, keys_seen
from ..dispatcher import DISPATCHER
from ..distributed_op import DistributedOp
from ..layout import Layout
from ..strategies import ring, rules
from ..strategies.all_gather import bsnd_pieces, gather, join_rows, natural_order, tnd_pieces
from ..strategies.data_parallel import whole_sequence_shards
from ..strategies.description import fail_sharded as _fail
from ..strategies.description import partial_where_replicated
from ..strategies.heads import head_slice, kv_for_heads
from ..strategies.ulysses import Ulysses, UlyssesLocal

NAMES = ("q", "k", "v")
# flash_attn's description: per layout, the named dims of q, k and v (strategies/rules.py).
TENSORS = {
    "BSND": {
        "q": ("B", "S1", "N1", "D"),
        "k": ("B", "S2", "N2", "D"),
        "v": ("B", "S2", "N2", "Dv"),
    },
    "BNSD": {
        "q": ("B", "N1", "S1", "D"),
        "k": ("B", "N2", "S2", "D"),
        "v": ("B", "N2", "S2", "Dv"),
    },
    "TND": {"q": ("T1", "N1", "D"), "k": ("T2", "N2", "D"), "v": ("T2", "N2", "Dv")},
}


def _positions(dims):
    """The (batch, sequence, heads, head dim) positions of a tensor's named dims (None: none)."""
    return tuple(
        next((i for i, d in enumerate(dims) if d in names), None)
        for names in (("B",), ("S1", "T1"), ("N1",), ("D",))
    )


# Read by these rules and by the raw operators' sharding strategies (sharding.py): per layout,
# the (batch, sequence, heads, head dim) positions of q, k, v and the output (TND has no batch
# dim), and the (batch, heads, sequence) positions of the lse.
DIMS = {layout: _positions(dims["q"]) for layout, dims in TENSORS.items()}
LSE_DIMS = {"BSND": (0, 1, 2), "BNSD": (0, 1, 2), "TND": (None, 0, 1)}


class FlashAttnDistributedOp(DistributedOp):
    def __init__(self, op_name: str = "flash_attn"):
        super().__init__(op_name)
        self._checked_globally = BoundedCache()

    def _check_global_call(self, args, kwargs):
        """The operator's own checks on the global problem, once per distinct call: an error is
        then the same ValueError on every rank, never one rank's (which would leave the others
        waiting in a collective). Each rank's metadata is a plan of its local problem, so it is
        left to the local call."""
        p = _platform.current()

        def summary(x):
            if p.is_dtensor(x):
                return ("dtensor", p.global_shape(x), str(x.dtype))
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                return ("tensor", tuple(x.shape), str(x.dtype))
            return x

        call = {k: v for k, v in kwargs.items() if k not in ("context_parallel", "metadata")}
        key = (tuple(summary(a) for a in args), tuple(sorted(
            (k, summary(v)) for k, v in call.items()
        )))  # fmt: skip
        if self._checked_globally.get(key):
            return
        p.check_global_call(self.op_name, args, call)
        self._checked_globally.put(key, True)

    def preprocess(self, args, kwargs):
        if kwargs.get("k_scale") is not None or kwargs.get("v_scale") is not None:
            raise ValueError(
                "k_scale: a quantized cache is read on one device; on a device mesh pass k and v "
                "in q's dtype (each rank's shard of a quantized cache: its local tensors)"
            )
        _check_dtensors(args)
        self._check_global_call(args, kwargs)
        call = _MeshInputs.of(args, kwargs)
        kwargs = dict(kwargs)
        strategy = _strategy(call, kwargs)
        kwargs = _plain_slopes(call, strategy, kwargs)
        args, kwargs = strategy.prepare(call, list(args), kwargs)
        kwargs, slice_sinks = _local_sinks(call, kwargs)
        # Key and value heads replicated while the query heads are split: each rank's gradient
        # is a partial sum over the heads axis too.
        heads_axes = call.layouts[0].tensor_map[call.n]
        extra = heads_axes if call.kv_heads_replicated else ()
        local_args = (call.p.to_local(args[0]),) + tuple(
            call.p.to_local(x, call.grad_placements(x, extra)) for x in args[1:]
        )
        q_layout = call.layouts[0]
        result = _MeshCall(
            layout_q=call.layout_q,
            layout_out=kwargs.get("layout_out", "BSND"),
            mesh=call.mesh,
            placements=tuple(lay.placements for lay in call.layouts),
            shapes=tuple(lay.shape for lay in call.layouts),
            kv_placements=tuple(Layout.of(a).placements for a in args[1:]),
            return_lse=bool(kwargs.get("return_softmax_lse", False)),
            slice_sinks=slice_sinks,
            order=call.order,
            strategy=strategy.name if q_layout.tensor_map[call.s] else "all_gather",
            inner=getattr(strategy, "inner", None),
            kv_heads_replicated=call.kv_heads_replicated,
        )
        return local_args, kwargs, result

    def infer_layout(self, cache_values):
        c = cache_values
        p = _platform.current()
        b, s, n, d = DIMS[c.layout_q]
        ob, os_, on, od = DIMS[c.layout_out]
        lb, ln, ls = LSE_DIMS[c.layout_q]
        q_shape, v_shape = c.shapes[0], c.shapes[2]
        # The output and the lse take q's batch, sequence and heads (TND: no batch).
        targets = {s: (os_, ls), n: (on, ln)}
        if b is not None:
            targets[b] = (ob, lb)
        out, lse = [], []
        for placement in c.placements[0]:
            target = targets.get(p.shard_dim(placement))
            out.append(p.shard(target[0]) if target else p.replicate())
            lse.append(p.shard(target[1]) if target else p.replicate())
        rank = 3 if b is None else 4
        out_shape, lse_shape = [0] * rank, [0] * (rank - 1)
        for dim, out_dim, lse_dim in ((b, ob, lb), (s, os_, ls), (n, on, ln)):
            if dim is not None:
                out_shape[out_dim], lse_shape[lse_dim] = q_shape[dim], q_shape[dim]
        out_shape[od] = v_shape[d]
        out_shape, lse_shape = tuple(out_shape), tuple(lse_shape)
        out_spec = (c.mesh, tuple(out), out_shape)
        if c.return_lse:
            lse_spec = (c.mesh, tuple(lse), lse_shape)
        else:
            lse_spec = (c.mesh, tuple(p.replicate() for _ in c.placements[0]), (0,))
        return (out_spec, lse_spec), None

    def get_expand_impl(self, func, infer_result, cache_values):
        local = self._expand(func, cache_values)
        c = cache_values
        if not c.kv_heads_replicated:
            return local
        # Query heads sharded over keys and values replicated there: each rank takes the key
        # and value heads its query heads need.
        n = DIMS[c.layout_q][2]
        heads = Layout(c.mesh, c.placements[0], c.shapes[0]).shard_range(n)
        nq, nkv = c.shapes[0][n], c.shapes[1][n]
        run = local or func

        def sliced(q, k, v, **kwargs):
            return run(q, *kv_for_heads((k, v), n, heads, nq, nkv), **kwargs)

        return sliced

    def _expand(self, func, cache_values):
        c = cache_values
        q_layout = Layout(c.mesh, c.placements[0], c.shapes[0])
        if c.strategy == "ulysses":
            return UlyssesLocal(
                func, c, DIMS[c.layout_q], DIMS[c.layout_out], LSE_DIMS[c.layout_q],
                _ulysses_args, _nested,
            )  # fmt: skip
        if c.strategy == "ring":
            return ring.RingLocal(
                func, c.layout_q, c.layout_out, DIMS[c.layout_q], q_layout, c.shapes[1],
                c.slice_sinks,
            )  # fmt: skip
        if c.strategy == "tnd_data_parallel":
            # The lengths were rebased to this rank's sequences in preprocess.
            heads = q_layout.shard_range(DIMS[c.layout_q][2])

            def tnd_local(q, k, v, **kw):
                if c.slice_sinks:
                    kw = dict(kw, sinks=head_slice(kw.get("sinks"), heads))
                return func(q, k, v, **_slopes_slice(kw, heads))

            return tnd_local
        # Keys and values sharded along their sequence arrive gathered in head-tail order.
        s = DIMS[c.layout_q][1]
        kv_gathered = bool(Layout(c.mesh, c.placements[1], c.shapes[1]).tensor_map[s])
        return _Local(
            func, c.layout_q, c.layout_out, q_layout, c.shapes[1], c.slice_sinks, c.order,
            kv_gathered,
        )  # fmt: skip


@dataclass(frozen=True)
class _MeshCall:
    """What preprocess decided for one call: everything the output layouts and the local call
    depend on (the dispatcher caches both by it)."""

    layout_q: str
    layout_out: str
    mesh: object
    placements: tuple  # q's, k's and v's as given
    shapes: tuple  # their global shapes
    kv_placements: tuple  # k's and v's after the strategy (gathered for all-gather)
    return_lse: bool
    slice_sinks: bool  # replicated sinks: each rank takes its query heads' entries
    order: str | None  # head-tail order, or None
    strategy: str  # "all_gather", "ring", "ulysses" or "tnd_data_parallel"
    inner: str | None = None  # the second axis's strategy of the Ulysses hybrid
    kv_heads_replicated: bool = False  # q's heads sharded, k's and v's replicated there


def _check_dtensors(args):
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


@dataclass(frozen=True)
class _MeshInputs:
    """q, k and v's layouts, checked against the rules every strategy shares
    (strategies/rules.py, with head parallel)."""

    p: object
    layout_q: str
    layouts: tuple
    mode: int
    order: str | None
    sharding: rules.Sharding

    @property
    def mesh(self):
        return self.layouts[0].mesh

    @property
    def dims(self):
        return DIMS[self.layout_q]

    @property
    def b(self):
        return self.dims[0]

    @property
    def s(self):
        return self.dims[1]

    @property
    def n(self):
        return self.dims[2]

    names = NAMES

    def maps(self):
        return tuple(lay.tensor_map for lay in self.layouts)

    @property
    def kv_heads_replicated(self) -> bool:
        """q's heads sharded while k's and v's are replicated on every mesh axis."""
        return self.sharding.kv_heads_replicated

    def grad_placements(self, x, extra_axes=()):
        """Where q's rows (batch or sequence) are split over a mesh axis on which an input is
        replicated, each rank's gradient of that input is a partial sum: say so, and DTensor
        sums it (and reduce-scatters it back for gathered keys and values)."""
        qm = self.layouts[0].tensor_map
        axes = (set(qm[self.b]) if self.b is not None else set()) | set(qm[self.s])
        return partial_where_replicated(self.p, x, axes | set(extra_axes))

    @classmethod
    def of(cls, args, kwargs) -> _MeshInputs:
        p = _platform.current()
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
        layouts = tuple(Layout.of(x) for x in args)
        named = dict(zip(NAMES, layouts, strict=True))
        dims = TENSORS[layout_q]
        sharding = rules.check(named, dims, layout_q, head_parallel=True)
        order = head_tail_order()
        if order is not None:
            rules.check_head_tail(named, dims, sharding)
        return cls(p, layout_q, layouts, kwargs.get("mask_mode", 0), order, sharding)


def _strategy(call: _MeshInputs, kwargs):
    """The strategy that serves the call (and the checks that choose it)."""
    requested = kwargs.pop("context_parallel", "all_gather")
    qm, km, vm = call.maps()
    s = call.s
    if not qm[s]:
        return _NoContextParallel
    if requested == "ulysses" or isinstance(requested, tuple):
        return Ulysses(requested)
    if (
        call.layout_q == "TND"
        and km[s] == qm[s] == vm[s]
        and requested == "all_gather"
        and call.order is None
    ):
        runs = whole_sequence_shards(
            _cumulative(kwargs.get("cu_seqlens_q")), _cumulative(kwargs.get("cu_seqlens_kv")),
            call.layouts[0], call.layouts[1],
        )  # fmt: skip
        if runs is not None:
            return _TndWholeSequences(runs)
    if kwargs.get("metadata") is not None:
        raise ValueError(
            "metadata: not supported with the query sequence sharded (the local calls' key "
            "ranges are set inside the op); without context parallel, pass each rank's plan "
            "of its local problem"
        )
    return _STRATEGIES[requested]


class _NoContextParallel:
    """Data and head parallel: q's sequence is whole on every rank, and so are k's and v's."""

    name = "no_context_parallel"

    @staticmethod
    def prepare(call, args, kwargs):
        return args, kwargs  # the rules left keys sharded only where q's sequence is


class _TndWholeSequences:
    """TND data parallel: q's and k/v's tokens sharded alike, every shard holding whole
    sequences in both; each rank attends its own sequences, nothing is gathered."""

    name = "tnd_data_parallel"

    def __init__(self, runs):
        self.runs = runs  # each shard's sequences [lo, hi), found when the strategy was chosen

    def prepare(self, call, args, kwargs):
        return args, _rebased_lengths(kwargs, *self.runs[call.layouts[0].shard_index(call.s)])


class _ContextParallel:
    """q's sequence sharded over one mesh axis; the shared checks of both key strategies."""

    name = "all_gather"

    @classmethod
    def prepare(cls, call, args, kwargs):
        q_layout, s = call.layouts[0], call.s
        qm = q_layout.tensor_map
        if len(qm[s]) > 1:
            _fail("q", q_layout, s, "the query sequence may be sharded over one mesh axis only")
        if call.layout_q == "TND" and call.mode == 4 and kwargs.get("win_right", -1) != 0:
            raise ValueError(
                "win_right: TND context parallel supports windows with win_right=0 (causal "
                "sliding windows); BSND and BNSD take any window"
            )
        for name in ("seqused_q", "seqused_kv"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}: not supported with the query sequence sharded")
        cls.check(call)
        return cls.move_keys(call, args), kwargs

    @staticmethod
    def check(call):
        pass

    @staticmethod
    def move_keys(call, args):
        """All-gather keys and values over the context-parallel axis (differentiable)."""
        s = call.s
        axes = call.layouts[0].tensor_map[s]
        for i, lay in enumerate(call.layouts[1:]):
            if lay.tensor_map[s]:
                args[i + 1] = gather(call.p, args[i + 1], call.mesh, axes)
        return args


class _Ring(_ContextParallel):
    """Context parallel with keys and values passed around the group (strategies/ring.py)."""

    name = "ring"
    check = staticmethod(ring.check)

    @staticmethod
    def move_keys(call, args):
        return args  # they travel during the call


_STRATEGIES = {
    strategy.name: strategy for strategy in (_NoContextParallel, _ContextParallel, _Ring)
}


def _local_sinks(call: _MeshInputs, kwargs):
    """Sinks replicated or sharded with q's heads; their local part, and whether each rank
    slices replicated sinks to its heads (their gradient is then also a partial sum over the
    head axis)."""
    p = call.p
    sinks = kwargs.get("sinks")
    if not p.is_dtensor(sinks):
        return kwargs, sinks is not None
    q_layout = call.layouts[0]
    heads = q_layout.tensor_map[call.n]
    sl = Layout.of(sinks)
    if sl.tensor_map[0] not in ((), heads):
        why = f"sinks must be replicated or sharded as q's heads ({q_layout.axes_text(call.n)})"
        _fail("sinks", sl, 0, why)
    kwargs = dict(kwargs, sinks=p.to_local(sinks, call.grad_placements(sinks, heads)))
    return kwargs, not sl.tensor_map[0]


class _Local:
    """The local call: the batch slice of the lengths, the head slice of replicated sinks, and
    for context parallel the rank's pieces (strategies/all_gather.py): its rows, or in
    head-tail order its two chunks apart, each with the keys its rows keep, then joined."""

    def __init__(self, func, layout, layout_out, q_layout, k_shape, slice_sinks, order, gathered):
        b, s, n, _ = DIMS[layout]
        self.func = func
        self.tnd = layout == "TND"
        self.s_dim, self.out_s_dim = s, DIMS[layout_out][1]
        self.lse_s_dim = LSE_DIMS[layout][2]
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

    def _tnd_calls(self, kwargs):
        """TND: per piece, its local cu_seqlens_q and per sequence the keys its rows see
        (seqused_kv against the whole key tensor, whose cu_seqlens_kv stay)."""
        cu_q = _cumulative(kwargs["cu_seqlens_q"])
        cu_k = _cumulative(kwargs["cu_seqlens_kv"])
        if cu_q[-1] != self.s1:
            raise ValueError(
                f"cu_seqlens_q: last entry {cu_q[-1]} must equal the query token count {self.s1}"
            )
        q_len = [e - s for s, e in zip(cu_q, cu_q[1:], strict=False)]
        k_len = [e - s for s, e in zip(cu_k, cu_k[1:], strict=False)]
        right = -1 if kwargs.get("mask_mode", 0) == 0 else 0  # TND windows are causal
        pieces = tnd_pieces(
            q_len, k_len, self.rows, right, self.cp_size, self.rank, self.order, "cu_seqlens_q"
        )
        calls = []
        for piece in pieces:
            call = dict(kwargs)
            call["cu_seqlens_q"] = torch.tensor([0, *_running(piece.q_used)], dtype=torch.int32)
            call["seqused_kv"] = torch.tensor(piece.k_used, dtype=torch.int32)
            call["max_seqlen_q"] = call["max_seqlen_kv"] = None
            calls.append(call)
        return pieces, calls, cu_k

    def _bsnd_calls(self, kwargs):
        """BSND and BNSD: every sequence has the same rows, so one key count and window per
        piece (``_local_band``)."""
        mode = kwargs.get("mask_mode", 0)
        right = 0 if mode == 3 else kwargs.get("win_right", -1)
        batch = self.batch[1] - self.batch[0]
        pieces = bsnd_pieces(
            [self.s1] * batch, [self.s2] * batch, self.rows, right, self.cp_size, self.rank,
            self.order, self.s1,
        )  # fmt: skip
        calls = []
        for piece in pieces:
            band = _local_band(piece.start, piece.count, self.s1, self.s2, batch, kwargs)
            calls.append(dict(kwargs, **band))
        return pieces, calls

    def __call__(self, q, k, v, **kwargs):
        b0, b1 = self.batch
        if not self.tnd:
            for name in ("seqused_q", "seqused_kv"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][b0:b1]
        if self.slice_sinks:
            kwargs["sinks"] = head_slice(kwargs.get("sinks"), self.heads)
        kwargs = _slopes_slice(kwargs, self.heads, None if self.tnd else self.batch)
        if not self.cp:
            return self.func(q, k, v, **kwargs)
        cu_k = None
        if self.tnd:
            pieces, calls, cu_k = self._tnd_calls(kwargs)
        elif kwargs.get("mask_mode", 0) != 0:
            pieces, calls = self._bsnd_calls(kwargs)
        else:  # every row sees every key: one call on the rank's rows as they are
            pieces, calls = None, [kwargs]
        if self.gathered:
            k = natural_order(k, self.s_dim, self.cp_size, self.order, cu_seqlens=cu_k)
            v = natural_order(v, self.s_dim, self.cp_size, self.order, cu_seqlens=cu_k)
        if pieces is None or len(pieces) == 1 and pieces[0].whole:
            return self.func(q, k, v, **calls[0])
        outs, lses = [], []
        for piece, call in zip(pieces, calls, strict=True):
            rows = piece.rows
            part = (
                q[(slice(None),) * self.s_dim + (rows,)]
                if isinstance(rows, slice)
                else (q.index_select(self.s_dim, rows))
            )
            out, lse = self.func(part, k, v, **call)
            outs.append(out)
            lses.append(lse)
        out = join_rows(outs, pieces, self.out_s_dim)
        if all(lse.numel() == 0 for lse in lses):
            return out, lses[0]
        return out, join_rows(lses, pieces, self.lse_s_dim)


def _cumulative(cu):
    """Cumulative lengths (a tensor or None) as a list of ints."""
    return None if cu is None else [int(x) for x in cu.tolist()]


def _running(values):
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _ulysses_args(kwargs, heads, batch):
    """Ulysses' local call: the sinks and ALiBi slopes of the rank's query heads."""
    kwargs = dict(kwargs, sinks=head_slice(kwargs.get("sinks"), heads))
    return _slopes_slice(kwargs, heads, batch)


def _nested(q, k, v, kwargs):
    """The Ulysses hybrids' second strategy: flash_attn on the head-sharded DTensors."""
    return DISPATCHER.dispatch("flash_attn", torch.ops.opmesh.flash_attn.default, (q, k, v), kwargs)


def _rebased_lengths(kwargs, lo, hi):
    """TND data parallel: the call's lengths for the rank's whole sequences [lo, hi), rebased to
    its shards."""
    kwargs = dict(kwargs)
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        cu = kwargs[name][lo : hi + 1].to(torch.int32)
        # A shard without sequences runs one empty sequence.
        kwargs[name] = cu - cu[0] if hi > lo else torch.zeros(2, dtype=torch.int32)
    for name in ("seqused_q", "seqused_kv"):
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][lo:hi] if hi > lo else torch.zeros(1, dtype=torch.int32)
    slopes = kwargs.get("alibi_slopes")
    if slopes is not None and slopes.dim() == 2:
        kwargs["alibi_slopes"] = slopes[lo:hi] if hi > lo else slopes.new_zeros(1, slopes.shape[1])
    if kwargs.get("metadata") is None:
        kwargs["max_seqlen_q"] = kwargs["max_seqlen_kv"] = None
    return kwargs


def _plain_slopes(call: _MeshInputs, strategy, kwargs):
    """ALiBi slopes as a plain tensor (a DTensor must be replicated), refused where the local
    calls would not keep the global diagonal their distances are measured from."""
    p = call.p
    slopes = kwargs.get("alibi_slopes")
    if slopes is None:
        return kwargs
    if p.is_dtensor(slopes):
        lay = Layout.of(slopes)
        for dim in range(len(lay.shape)):
            if lay.tensor_map[dim]:
                _fail("alibi_slopes", lay, dim, "the slopes must be replicated")
        slopes = p.to_local(slopes)
    if call.layouts[0].tensor_map[call.s]:
        name = strategy.name
        if name == "ring" or getattr(strategy, "inner", None) is not None:
            raise ValueError(
                "alibi_slopes: ALiBi runs on a sharded query sequence with "
                "context_parallel='all_gather' (mask_mode=3) or 'ulysses', not "
                f"{kwargs.get('context_parallel', name)!r}"
            )
        if name == "all_gather" and call.mode != 3:
            raise ValueError(
                "alibi_slopes: with context_parallel='all_gather' ALiBi needs mask_mode=3 (the "
                f"local calls keep the global diagonal only then), got mask_mode={call.mode}; "
                "use context_parallel='ulysses'"
            )
    return dict(kwargs, alibi_slopes=slopes)


def _slopes_slice(kwargs, heads, batch=None):
    """The ALiBi slopes ([Nq] or [B, Nq]) of a local call's query heads ``[h0, h1)`` and, for
    slopes per batch entry, its batch entries ``batch = [b0, b1)`` (None: all)."""
    slopes = kwargs.get("alibi_slopes")
    if slopes is None:
        return kwargs
    slopes = slopes[..., heads[0] : heads[1]]
    if slopes.dim() == 2 and batch is not None:
        slopes = slopes[batch[0] : batch[1]]
    return dict(kwargs, alibi_slopes=slopes)


def _local_band(start, rows, s1, s2, batch, kwargs):
    """The local call's key count and window for global query rows [start, start + rows) of
    S1 against all S2 keys, so that every row sees exactly the keys it sees in the global call.

    The mask's diagonal is bottom-right aligned: global row i sits at key i + S2 - S1, local
    row i - start at i - start + u - rows for ``u = seqused_kv``. Cutting the keys at the last
    row's diagonal plus its right window (u = start + rows + S2 - S1 + win_right, at most S2)
    keeps every key a row can see; the local diagonal then lies ``shift = u - (start + rows +
    S2 - S1)`` keys to the right of the global one, which the window's sides absorb (left side
    wider, right side narrower by ``shift``, never below 0)."""
    mode = kwargs.get("mask_mode", 0)
    left, right = kwargs.get("win_left", -1), kwargs.get("win_right", -1)
    if mode == 3:
        left, right = -1, 0
    diagonal_end = start + rows + s2 - s1
    used = keys_seen(start + rows, s1, s2, right)
    out = {"seqused_kv": torch.full((batch,), used, dtype=torch.int32)}
    shift = used - diagonal_end
    if mode == 4 and used > 0 and shift:
        out["win_left"] = -1 if left < 0 else left + shift
        out["win_right"] = -1 if right < 0 else right - shift
    return out
