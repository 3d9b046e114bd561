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

D is never sharded, no input may be Partial. Without context parallel, ``metadata`` is each
rank's plan of its local problem (its batch slice and heads), made with flash_attn_metadata
there. The outputs take q's sharding: attn_out's batch, sequence and head dims follow q's, the
lse ``[B, Nq, S1]`` likewise. Gradients flow through the DTensor conversions and the operator's
own backward, so they come back with the inputs' placements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import platform as _platform
from ..._bounded_cache import BoundedCache
from ..all_to_all import AllToAll
from ..context_parallel import (
    chunk_pair,
    from_head_tail,
    head_tail_order,
    keys_seen,
    to_head_tail,
)
from ..dispatcher import DISPATCHER
from ..distributed_op import DistributedOp
from ..gather_cache import gathered
from ..layout import Layout
from ..ring import RingAttention, RingGroup

NAMES = ("q", "k", "v")
# flash_attn's layout table, read by these rules and by the raw operators' sharding strategies
# (sharding.py): per layout, the (batch, sequence, heads, head dim) positions of q, k, v and the
# output (TND has no batch dim), and the (batch, heads, sequence) positions of the lse.
DIMS = {"BSND": (0, 1, 2, 3), "BNSD": (0, 2, 1, 3), "TND": (None, 0, 1, 2)}
LSE_DIMS = {"BSND": (0, 1, 2), "BNSD": (0, 1, 2), "TND": (None, 0, 1)}


def _ceil_div(a, b):
    return -(-a // b)


def keeps_gqa_groups(nq: int, nkv: int, shards: int) -> bool:
    """Whether splitting ``nq`` query heads and ``nkv`` key heads ``shards`` ways (DTensor's
    split: chunks of the ceiling) leaves every query head on its key head's rank."""
    if nkv == 0 or nq % nkv:
        return False
    return _ceil_div(nq, shards) == (nq // nkv) * _ceil_div(nkv, shards)


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
            return _UlyssesLocal(func, c)
        if c.strategy == "ring":
            return _RingLocal(func, c.layout_q, c.layout_out, q_layout, c.shapes[1], c.slice_sinks)
        if c.strategy == "tnd_data_parallel":
            # The lengths were rebased to this rank's sequences in preprocess.
            heads = q_layout.shard_range(DIMS[c.layout_q][2])

            def tnd_local(q, k, v, **kw):
                if c.slice_sinks:
                    kw = dict(kw, sinks=_head_slice(kw.get("sinks"), heads))
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


def _fail(name, lay, dim, why):
    raise ValueError(f"{name}: dim {dim} is sharded over mesh axes {lay.axes_text(dim)}; {why}")


@dataclass(frozen=True)
class _MeshInputs:
    """q, k and v's layouts, checked against the rules every strategy shares: one mesh and
    layout, no Partial, D replicated, batch and heads sharded alike, no GQA group cut."""

    p: object
    layout_q: str
    layouts: tuple
    mode: int
    order: str | None

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

    def maps(self):
        return tuple(lay.tensor_map for lay in self.layouts)

    @property
    def kv_heads_replicated(self) -> bool:
        """q's heads sharded while k's and v's are replicated on every mesh axis."""
        qm, km, _vm = self.maps()
        return bool(qm[self.n]) and not km[self.n]

    def grad_placements(self, x, extra_axes=()):
        """Where q's rows (batch or sequence) are split over a mesh axis on which an input is
        replicated, each rank's gradient of that input is a partial sum: say so, and DTensor
        sums it (and reduce-scatters it back for gathered keys and values)."""
        qm = self.layouts[0].tensor_map
        axes = (set(qm[self.b]) if self.b is not None else set()) | set(qm[self.s])
        axes |= set(extra_axes)
        p = self.p
        return tuple(
            p.partial() if axis in axes and p.shard_dim(pl) is None else pl
            for axis, pl in enumerate(p.placements_of(x))
        )

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
        call = cls(p, layout_q, layouts, kwargs.get("mask_mode", 0), head_tail_order())
        call._check_layouts()
        return call

    def _check_layouts(self):
        rank = 3 if self.layout_q == "TND" else 4
        for name, lay in zip(NAMES, self.layouts, strict=True):
            if lay.mesh != self.mesh:
                raise ValueError(f"{name}: must be on the same device mesh as q")
            if lay.ndim != rank:
                raise ValueError(
                    f"{name}: expected a {rank}-D DTensor ({self.layout_q}), got {lay.ndim}-D"
                )
            partial = lay.partial_axes()
            if partial:
                raise ValueError(
                    f"{name}: Partial placement on mesh axis {lay.axis_names[partial[0]]!r} is "
                    "not supported; reduce it (redistribute to Replicate or Shard) first"
                )
        b, _s, n, d = self.dims
        qm, km, vm = self.maps()
        q_layout = self.layouts[0]
        for name, lay, tm in zip(NAMES, self.layouts, (qm, km, vm), strict=True):
            if tm[d]:
                _fail(name, lay, d, "the head dim D must be replicated")
        for name, lay, tm in zip(NAMES[1:], self.layouts[1:], (km, vm), strict=True):
            if b is not None and tm[b] != qm[b]:
                why = f"the batch dim must be sharded as q's ({q_layout.axes_text(b)})"
                _fail(name, lay, b, why)
            if tm[n] != qm[n] and not (qm[n] and not km[n] and not vm[n]):
                _fail(
                    name,
                    lay,
                    n,
                    f"the head dim must be sharded as q's ({q_layout.axes_text(n)}), or k's and "
                    "v's replicated while q's is sharded",
                )
        if qm[n]:
            if len(qm[n]) > 1:
                _fail("q", q_layout, n, "heads may be sharded over one mesh axis only")
            shards = q_layout.num_shards(n)
            nq, nkv = q_layout.shape[n], self.layouts[1].shape[n]
            if km[n] and not keeps_gqa_groups(nq, nkv, shards):
                why = (
                    f"splitting {nq} query heads and {nkv} key heads {shards} ways would cut a "
                    "group of query heads from its key head"
                )
                _fail("q", q_layout, n, why)
        if self.order is not None:
            self._check_head_tail()

    def _check_head_tail(self):
        qm = self.layouts[0].tensor_map
        if not qm[self.s]:
            raise ValueError(
                "head_tail_cp: needs q's sequence sharded for context parallelism (over one "
                "mesh axis)"
            )
        cp = self.layouts[0].num_shards(self.s)
        for name, lay in zip(NAMES, self.layouts, strict=True):
            if (name == "q" or lay.tensor_map[self.s]) and lay.shape[self.s] % (2 * cp) != 0:
                raise ValueError(
                    f"{name}: dim {self.s} has size {lay.shape[self.s]}, not a multiple of 2 * cp "
                    f"= {2 * cp}, as head_tail_cp needs"
                )


def _strategy(call: _MeshInputs, kwargs):
    """The strategy that serves the call (and the checks that choose it)."""
    requested = kwargs.pop("context_parallel", "all_gather")
    qm, km, vm = call.maps()
    s = call.s
    if not qm[s]:
        return _NoContextParallel
    if requested == "ulysses" or isinstance(requested, tuple):
        return _Ulysses(requested)
    if (
        call.layout_q == "TND"
        and km[s] == qm[s] == vm[s]
        and requested == "all_gather"
        and call.order is None
    ):
        runs = _whole_sequence_shards(kwargs, call.layouts[0], call.layouts[1])
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
        for name, lay in zip(NAMES[1:], call.layouts[1:], strict=True):
            if lay.tensor_map[call.s]:
                _fail(name, lay, call.s, "the key sequence may be sharded only when q's is")
        return args, kwargs


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
        for name, lay in zip(NAMES[1:], call.layouts[1:], strict=True):
            tm = lay.tensor_map
            if tm[s] and tm[s] != qm[s]:
                why = (
                    "the key sequence must be replicated or sharded as q's "
                    f"({q_layout.axes_text(s)})"
                )
                _fail(name, lay, s, why)
        return cls.move_keys(call, args), kwargs

    @staticmethod
    def check(call):
        pass

    @staticmethod
    def move_keys(call, args):
        """All-gather keys and values over the context-parallel axis (differentiable)."""
        p, s = call.p, call.s
        axis = call.layouts[0].tensor_map[s][0]
        for i, lay in enumerate(call.layouts[1:]):
            if lay.tensor_map[s]:
                placements = list(p.placements_of(args[i + 1]))
                placements[axis] = p.replicate()
                args[i + 1] = gathered(args[i + 1], call.mesh, tuple(placements))
        return args


class _Ring(_ContextParallel):
    """Context parallel with keys and values passed around the group (ring.py)."""

    name = "ring"

    @staticmethod
    def check(call):
        if call.layout_q == "TND":
            raise ValueError(
                "layout_q: TND context parallel uses the all-gather strategy (in sequence or "
                "head-tail order), not the ring"
            )
        if call.mode not in (0, 3):
            raise ValueError(
                f"mask_mode: the ring strategy supports masks 0 and 3, got {call.mode}; use "
                "context_parallel='all_gather' for windows"
            )
        q_layout, s = call.layouts[0], call.s
        for name, lay in zip(NAMES[1:], call.layouts[1:], strict=True):
            if lay.tensor_map[s] != q_layout.tensor_map[s]:
                raise ValueError(
                    f"{name}: dim {s} is sharded over mesh axes {lay.axes_text(s)}; the ring "
                    f"strategy needs it sharded as q's ({q_layout.axes_text(s)})"
                )
        if call.mode == 3 and q_layout.shape[s] != call.layouts[1].shape[s]:
            raise ValueError(
                f"k: the ring strategy with a causal mask needs as many keys as queries, got "
                f"{call.layouts[1].shape[s]} and {q_layout.shape[s]}"
            )
        if call.order is not None:
            raise ValueError(
                "head_tail_cp: the ring strategy takes contiguous shards; use "
                "context_parallel='all_gather' with head-tail order"
            )

    @staticmethod
    def move_keys(call, args):
        return args  # they travel during the call


class _Ulysses:
    """Ulysses (all-to-all) context parallel: q, k and v sharded along their sequence over the
    context-parallel axis are exchanged all-to-all into full sequences sharded by heads, each
    rank attends its heads locally, and the output (and lse) is exchanged back. Key and value
    heads fewer than the ranks are repeated just enough for every rank's query heads to find
    theirs. With a second strategy (``("ulysses", "ring")`` or ``("ulysses", "all_gather")``)
    the sequence is sharded over two mesh axes: the first is exchanged all-to-all, the second
    runs that strategy on the head-sharded tensors."""

    name = "ulysses"

    def __init__(self, requested):
        self.inner = None
        if isinstance(requested, tuple):
            if (
                len(requested) != 2
                or requested[0] != "ulysses"
                or requested[1]
                not in (
                    "ring",
                    "all_gather",
                )
            ):
                raise ValueError(
                    "context_parallel: a two-axis strategy is ('ulysses', 'ring') or "
                    f"('ulysses', 'all_gather'), got {requested!r}"
                )
            self.inner = requested[1]

    def prepare(self, call, args, kwargs):
        q_layout, s, n = call.layouts[0], call.s, call.n
        axes = q_layout.tensor_map[s]
        want = 1 if self.inner is None else 2
        if len(axes) != want:
            what = "one mesh axis" if want == 1 else "two mesh axes (Ulysses over the first)"
            strategy = "'ulysses'" if self.inner is None else f"('ulysses', {self.inner!r})"
            _fail(
                "q", q_layout, s, f"context_parallel={strategy} needs the query sequence sharded "
                f"over {what}",
            )  # fmt: skip
        for name, lay in zip(NAMES[1:], call.layouts[1:], strict=True):
            if lay.tensor_map[s] != axes:
                _fail(
                    name,
                    lay,
                    s,
                    f"Ulysses needs the key sequence sharded as q's ({q_layout.axes_text(s)})",
                )
        if q_layout.tensor_map[n]:
            _fail("q", q_layout, n, "Ulysses shards the heads itself; pass them replicated")
        if self.inner is not None:
            if call.order is not None:
                raise ValueError(
                    "head_tail_cp: the two-axis Ulysses hybrid takes contiguous shards"
                )
            if kwargs.get("sinks") is not None:
                raise ValueError("sinks: not supported by the two-axis Ulysses hybrid")
        for name in ("seqused_q", "seqused_kv", "metadata"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}: not supported with Ulysses context parallel")
        if kwargs.get("sinks") is not None and call.p.is_dtensor(kwargs["sinks"]):
            if Layout.of(kwargs["sinks"]).tensor_map[0]:
                raise ValueError("sinks: pass them replicated with Ulysses context parallel")
        return args, kwargs


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


class _UlyssesLocal:
    """The Ulysses strategy's local call (see ``_Ulysses``): one all-to-all per tensor each
    way (all_to_all.py)."""

    def __init__(self, func, c):
        self.p = _platform.current()
        self.func, self.c = func, c
        b, s, n, _ = DIMS[c.layout_q]
        self.b, self.s, self.n = b, s, n
        self.out_s, self.out_n = DIMS[c.layout_out][1], DIMS[c.layout_out][2]
        self.lse_s, self.lse_n = LSE_DIMS[c.layout_q][2], LSE_DIMS[c.layout_q][1]
        q_layout = Layout(c.mesh, c.placements[0], c.shapes[0])
        self.axis = q_layout.tensor_map[s][0]
        self.cp = self.p.mesh_shape(c.mesh)[self.axis]
        self.position = self.p.mesh_coordinate(c.mesh)[self.axis]
        self.inner = c.inner
        self.repeat = kv_repeat(c.shapes[0][n], c.shapes[1][n], self.cp)
        # Every rank's rows of q's and of k's sequence, and its query and key heads after the
        # exchange (DTensor's split: chunks of the ceiling).
        self.q_rows = _sizes(c.shapes[0][s], self.cp)
        self.k_rows = _sizes(c.shapes[1][s], self.cp)
        self.q_heads = _sizes(c.shapes[0][n], self.cp)
        self.batch = q_layout.shard_range(b) if b is not None else None
        self.k_heads = _sizes(c.shapes[1][n] * self.repeat, self.cp)

    def _exchange(self, x, placements, shape, from_dim, to_dim):
        """The hybrid's exchange through DTensor: x's shard with ``from_dim`` sharded over the
        Ulysses axis, as the DTensor with ``to_dim`` sharded there instead."""
        p = self.p
        d = p.from_local(x, self.c.mesh, tuple(placements), tuple(shape))
        target = list(placements)
        target[self.axis] = p.shard(to_dim)
        moved = p.redistribute(d, self.c.mesh, tuple(target))
        return moved, tuple(target)

    def _to_heads(self, x, s_dim, n_dim, rows, heads):
        group = self.p.axis_group(self.c.mesh, self.axis)
        return AllToAll.apply(x, group, self.position, n_dim, s_dim, heads, rows)

    def _to_rows(self, x, s_dim, n_dim, rows, heads):
        group = self.p.axis_group(self.c.mesh, self.axis)
        return AllToAll.apply(x, group, self.position, s_dim, n_dim, rows, heads)

    def __call__(self, q, k, v, **kwargs):
        c, n, s = self.c, self.n, self.s
        if self.repeat > 1:
            k = k.repeat_interleave(self.repeat, dim=n)
            v = v.repeat_interleave(self.repeat, dim=n)
        if self.inner is not None:
            shapes = [list(sh) for sh in c.shapes]
            for sh in shapes[1:]:
                sh[n] *= self.repeat
            moved = [
                self._exchange(x, pl, sh, s, n)
                for x, pl, sh in zip((q, k, v), c.placements, shapes, strict=True)
            ]
            return self._hybrid(moved, kwargs)
        qh = self._to_heads(q, s, n, self.q_rows, self.q_heads)
        kh = self._to_heads(k, s, n, self.k_rows, self.k_heads)
        vh = self._to_heads(v, s, n, self.k_rows, self.k_heads)
        h0 = sum(self.q_heads[: self.position])
        heads = (h0, h0 + self.q_heads[self.position])
        kwargs = dict(kwargs)
        kwargs["sinks"] = _head_slice(kwargs.get("sinks"), heads)
        kwargs = _slopes_slice(kwargs, heads, self.batch)
        cu = {}
        if c.order is not None:
            tnd = c.layout_q == "TND"
            cu_q = kwargs["cu_seqlens_q"] if tnd else None
            cu_k = kwargs["cu_seqlens_kv"] if tnd else None
            qh = from_head_tail(qh, s, self.cp, c.order, cu_seqlens=cu_q)
            kh = from_head_tail(kh, s, self.cp, c.order, cu_seqlens=cu_k)
            vh = from_head_tail(vh, s, self.cp, c.order, cu_seqlens=cu_k)
            cu = {"cu_seqlens": cu_q}
        out, lse = self.func(qh, kh, vh, **kwargs)
        if c.order is not None:
            out = to_head_tail(out, self.out_s, self.cp, c.order, **cu)
            if c.return_lse:
                lse = to_head_tail(lse, self.lse_s, self.cp, c.order, **cu)
        out = self._to_rows(out, self.out_s, self.out_n, self.q_rows, self.q_heads)
        # Every rank exchanges the lse when it is asked for (a rank with no heads too).
        if c.return_lse:
            lse = self._to_rows(lse, self.lse_s, self.lse_n, self.q_rows, self.q_heads)
        return out, lse

    def _hybrid(self, moved, kwargs):
        """Ulysses over the first axis, then the second strategy over the second on the
        head-sharded DTensors (a nested call of the public function), and back."""
        p, c = self.p, self.c
        (qd, _), (kd, _), (vd, _) = moved
        kwargs = {**kwargs, "context_parallel": self.inner}
        out, lse = DISPATCHER.dispatch(
            "flash_attn", torch.ops.opmesh.flash_attn.default, (qd, kd, vd), kwargs
        )
        target_out = list(p.placements_of(out))
        target_out[self.axis] = p.shard(self.out_s)
        out = p.to_local(p.redistribute(out, c.mesh, tuple(target_out)))
        if c.return_lse:
            target = list(p.placements_of(lse))
            target[self.axis] = p.shard(self.lse_s)
            lse = p.to_local(p.redistribute(lse, c.mesh, tuple(target)))
        else:
            lse = p.to_local(lse)
        return out, lse


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
        b0, b1 = self.batch
        if not self.tnd:
            for name in ("seqused_q", "seqused_kv"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][b0:b1]
        if self.slice_sinks:
            kwargs["sinks"] = _head_slice(kwargs.get("sinks"), self.heads)
        kwargs = _slopes_slice(kwargs, self.heads, None if self.tnd else self.batch)
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


def _sizes(total, shards):
    """Each shard's size of a dim of ``total`` split ``shards`` ways (DTensor's split)."""
    return [hi - lo for lo, hi in _shard_ranges(total, shards)]


def _head_slice(sinks, heads):
    return sinks if sinks is None else sinks[heads[0] : heads[1]]


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
        # The last local row is row hi - qs - 1 of the sequence: the diagonal stays where the
        # global call has it.
        seen = keys_seen(hi - qs, qe - qs, k_len, -1 if mode == 0 else 0)
        used.append(seen if rows or mode == 0 else 0)
    return local, used


class _RingLocal:
    """The ring strategy's local call (opmesh/distributed/ring.py)."""

    def __init__(self, func, layout, layout_out, q_layout, k_shape, slice_sinks):
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
        sinks = kwargs.get("sinks")
        if self.slice_sinks:
            sinks = _head_slice(sinks, self.heads)
        options = dict(
            layout_q=self.layout,
            layout_kv=self.layout,
            layout_out=self.layout_out,
            softmax_scale=kwargs.get("softmax_scale"),
            softcap=kwargs.get("softcap", 0.0),
        )
        out, lse = RingAttention.apply(
            q, k, v, sinks, self.ring, kwargs.get("mask_mode", 0) == 3, options
        )
        if not kwargs.get("return_softmax_lse", False):
            lse = torch.empty(0, device=q.device)
        return out, lse
