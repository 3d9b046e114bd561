"""The DeepSeek-sparse-attention operators on DTensors: one set of layout rules for all of them.

The ops served (one class, constructed with each op's name):

* ``dense_lightning_indexer_softmax_lse`` and ``lightning_indexer`` (the indexers),
* ``sparse_flash_attention`` (differentiable in query, key, value, the ropes and sinks),
* ``indexer_kl_loss`` / ``sparse_indexer_kl_loss`` (the ``DFunction`` fronts, returning the
  loss) and the fused ``dense_lightning_indexer_grad_kl_loss`` /
  ``sparse_lightning_indexer_grad_kl_loss``.

Every tensor argument is described by its named dims per layout (``TABLES``): the batch ``B``,
the query sequence ``S1`` / ``T1`` (query-side tensors: queries, weights, statistics, the
indices), the key sequence ``S2`` / ``T2`` (key-side tensors: keys, values, key ropes), and dims
that stay replicated (heads, head dims, the top-k dim). The rules:

* no Partial input; one mesh; heads, head dims and top-k replicated (refused by name);
* the batch is sharded alike in every tensor that has one;
* query-side sequences are sharded alike (context parallel, or TND data parallel);
* a key sequence is replicated, or sharded exactly like the query sequence.

Strategies, chosen per call:

* no context parallel: each rank runs its batch slice (BSND lengths sliced alike);
* TND data parallel: query and key tokens sharded alike over one mesh axis with every shard
  boundary on a sequence boundary in both: each rank runs its whole sequences, nothing moves;
* context parallel: each rank computes its query rows. Sharded keys are all-gathered over the
  query sequence's mesh axes (DTensor's redistribute: the gradient goes back reduce-scattered)
  and put back in natural order. The lengths each local call receives are rewritten so that
  every row keeps its global key range: a sequence's keys are cut after the last key its local
  rows can see (TND keeps only those keys, sequence by sequence). In head-tail order
  (``context_parallel.py``, both orders, BSND and TND) a rank's two chunks are computed apart
  and joined. Indices of the sparse operators that point past a sequence's kept keys (keys no
  local row can see) are dropped to -1, which the operators skip as the global call does.

Outputs: query-side outputs (statistics, indices, attention) take the query's sharding; the loss
is ``Partial`` on every axis that splits the query rows (batch or sequence); the fused losses'
key gradient is ``Partial`` on the context-parallel axes (global key shape, the input's order).
Paged keys (``PA_BSND``) are refused on a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ... import platform as _platform
from ..._bounded_cache import BoundedCache
from ..._schema import MAX_TOKENS, defaults, positional
from ..context_parallel import head_tail_order, to_head_tail
from ..distributed_op import DistributedOp
from ..layout import Layout
from ..strategies import rules
from ..strategies.all_gather import (
    bsnd_pieces,
    gather,
    join_rows,
    kept_keys,
    natural_order,
    tnd_pieces,
)
from ..strategies.data_parallel import whole_sequence_shards
from ..strategies.description import (
    GROUP_STATS_DIMS,
    KEY_DIMS,
    QUERY_DIMS,
    SELECTION_DIMS,
    CallTensors,
    OpTable,
    grad_placements,
    local_lengths,
    seq_dim,
    side_of,
)
from ..strategies.description import int64 as _int64
from ..strategies.description import ints as _ints
from ..strategies.description import take_rows as _take

# -- the tables ----------------------------------------------------------------------------------

_WEIGHTS = {"BSND": ("B", "S1", "N1"), "TND": ("T1", "N1")}
_STATS = {"BSND": ("B", "N2", "S1"), "TND": ("N2", "T1")}
_ROPE_Q = {"BSND": ("B", "S1", "N1", "Dr"), "TND": ("T1", "N1", "Dr")}
_ROPE_K = {"BSND": ("B", "S2", "N2", "Dr"), "TND": ("T2", "N2", "Dr")}
_VALUE = {"BSND": ("B", "S2", "N2", "Dv"), "TND": ("T2", "N2", "Dv")}

_KL_TENSORS = {
    "query_index": QUERY_DIMS,
    "key_index": KEY_DIMS,
    "weights": _WEIGHTS,
    "query": QUERY_DIMS,
    "key": KEY_DIMS,
    "query_rope": _ROPE_Q,
    "key_rope": _ROPE_K,
    "softmax_max": GROUP_STATS_DIMS,
    "softmax_sum": GROUP_STATS_DIMS,
    "softmax_max_index": _STATS,
    "softmax_sum_index": _STATS,
}
_KL_FRONT = (
    "query_index",
    "key_index",
    "weights",
    "query",
    "key",
    "softmax_max",
    "softmax_sum",
    "scale_value",
    "query_rope",
    "key_rope",
    "actual_seq_qlen",
    "actual_seq_klen",
    "layout",
    "sparse_mode",
    "pre_tokens",
    "next_tokens",
    "cmp_ratio",
    "cmp_residual_key",
)
# The sparse front takes the selection after the main key.
_SPARSE_KL_FRONT = (*_KL_FRONT[:5], "sparse_indices", *_KL_FRONT[5:])
_KL_GRADS = (("grad", "query_index"), ("grad", "key_index"), ("grad", "weights"), ("loss",))


TABLES = {
    "dense_lightning_indexer_softmax_lse": OpTable(
        params=positional("dense_lightning_indexer_softmax_lse"),
        defaults=defaults("dense_lightning_indexer_softmax_lse"),
        layout="layout",
        key_layout=None,
        lengths=("actual_seq_qlen", "actual_seq_klen"),
        tensors={"query_index": QUERY_DIMS, "key_index": KEY_DIMS, "weights": _WEIGHTS},
        outputs=(("query", _STATS), ("query", _STATS)),
    ),
    "indexer_kl_loss": OpTable(
        params=_KL_FRONT,
        defaults=defaults("dense_lightning_indexer_grad_kl_loss"),
        layout="layout",
        key_layout=None,
        lengths=("actual_seq_qlen", "actual_seq_klen"),
        tensors=_KL_TENSORS,
        outputs=(("loss",),),
    ),
    "dense_lightning_indexer_grad_kl_loss": OpTable(
        params=positional("dense_lightning_indexer_grad_kl_loss"),
        defaults=defaults("dense_lightning_indexer_grad_kl_loss"),
        layout="layout",
        key_layout=None,
        lengths=("actual_seq_qlen", "actual_seq_klen"),
        tensors=_KL_TENSORS,
        outputs=_KL_GRADS,
    ),
    "sparse_indexer_kl_loss": OpTable(
        params=_SPARSE_KL_FRONT,
        defaults=defaults("sparse_lightning_indexer_grad_kl_loss"),
        layout="layout",
        key_layout=None,
        lengths=("actual_seq_qlen", "actual_seq_klen"),
        tensors={**_KL_TENSORS, "sparse_indices": SELECTION_DIMS},
        outputs=(("loss",),),
        indices="sparse_indices",
    ),
    "sparse_lightning_indexer_grad_kl_loss": OpTable(
        params=positional("sparse_lightning_indexer_grad_kl_loss"),
        defaults=defaults("sparse_lightning_indexer_grad_kl_loss"),
        layout="layout",
        key_layout=None,
        lengths=("actual_seq_qlen", "actual_seq_klen"),
        tensors={**_KL_TENSORS, "sparse_indices": SELECTION_DIMS},
        outputs=_KL_GRADS,
        indices="sparse_indices",
    ),
    "lightning_indexer": OpTable(
        params=positional("lightning_indexer"),
        defaults=defaults("lightning_indexer"),
        layout="layout_query",
        key_layout="layout_key",
        lengths=("actual_seq_lengths_query", "actual_seq_lengths_key"),
        tensors={"query": QUERY_DIMS, "key": KEY_DIMS, "weights": _WEIGHTS},
        outputs=(("query", SELECTION_DIMS), ("query", SELECTION_DIMS)),
    ),
    "sparse_flash_attention": OpTable(
        params=positional("sparse_flash_attention"),
        defaults=defaults("sparse_flash_attention"),
        layout="layout_query",
        key_layout="layout_kv",
        lengths=("actual_seq_lengths_query", "actual_seq_lengths_kv"),
        tensors={
            "query": QUERY_DIMS,
            "key": KEY_DIMS,
            "value": _VALUE,
            "sparse_indices": SELECTION_DIMS,
            "query_rope": _ROPE_Q,
            "key_rope": _ROPE_K,
            "sinks": {"BSND": ("N1",), "TND": ("N1",)},
        },
        outputs=(("query", QUERY_DIMS), ("query", GROUP_STATS_DIMS), ("query", GROUP_STATS_DIMS)),
        indices="sparse_indices",
        block_size="sparse_block_size",
    ),
}


# -- what preprocess decides ---------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _MeshCall(CallTensors):
    """Everything the output layouts and the local call depend on (the dispatcher caches both by
    it). One object per distinct layout, kept by the DistributedOp: compared by identity, so the
    dispatcher's lookup hashes no mesh or placements."""

    layout: str
    mode: int
    mesh: object
    tensors: tuple  # (name, placements as given, global shape)
    order: str | None
    seq_axes: tuple  # the mesh axes sharding the query sequence
    batch_axes: tuple
    strategy: str  # "local", "tnd_data_parallel" or "context_parallel"
    gathered: tuple  # key-side tensors all-gathered for context parallel


class DsaDistributedOp(DistributedOp):
    def __init__(self, op_name: str = "dense_lightning_indexer_softmax_lse"):
        if op_name not in TABLES:
            raise ValueError(f"op_name: DsaDistributedOp serves {sorted(TABLES)}, got {op_name!r}")
        super().__init__(op_name)
        self.table = TABLES[op_name]
        # Layouts that passed the rules -> their strategy, axes and _MeshCall per strategy.
        self._checked = BoundedCache()
        # Per layout: each tensor's side and sequence dim.
        self._dims = {
            layout: {
                n: (side_of(d[layout]), seq_dim(d[layout])) for n, d in self.table.tensors.items()
            }
            for layout in ("BSND", "TND")
        }

    # -- preprocess ---------------------------------------------------------------------------

    def preprocess(self, args, kwargs):
        p = _platform.current()
        t = self.table
        if len(args) > len(t.params):
            raise ValueError(
                f"{self.op_name}: expected at most {len(t.params)} positional arguments, got "
                f"{len(args)}"
            )
        named = {**t.defaults, **dict(zip(t.params, args, strict=False)), **kwargs}
        named = local_lengths(named, t.lengths)
        if named.get("key_scale") is not None or named.get("value_scale") is not None:
            raise ValueError(
                "key_scale: a quantized key and value are read on one device; on a device mesh "
                "pass them in the query's dtype (each rank's shard: its local tensors)"
            )
        layout = named[t.layout]
        if t.key_layout is not None:
            key_layout = named[t.key_layout]
            if key_layout == "PA_BSND" or named.get("block_table") is not None:
                raise ValueError(
                    f"{t.key_layout}: paged keys (PA_BSND) are not supported on a device mesh; "
                    "pass the keys in the query's layout"
                )
            if key_layout != layout:
                raise ValueError(
                    f"{t.key_layout}: on a mesh the keys take the query's layout {layout!r}, got "
                    f"{key_layout!r}"
                )
        if layout not in ("BSND", "TND"):
            raise ValueError(f"{t.layout}: expected 'BSND' or 'TND', got {layout!r}")
        tensors = {n: named[n] for n in t.tensors if named.get(n) is not None}
        for name, value in tensors.items():
            if not p.is_dtensor(value):
                raise ValueError(
                    f"{name}: expected a DTensor like the other inputs, got {type(value).__name__}"
                )
        order = head_tail_order()
        first = next(iter(tensors.values()))
        mesh = p.mesh_of(first)
        described = tuple((n, p.placements_of(x), p.global_shape(x)) for n, x in tensors.items())
        key = (
            layout,
            named["sparse_mode"],
            mesh,
            all(p.mesh_of(x) is mesh for x in tensors.values()),
            described,
            order,
            named["pre_tokens"] < MAX_TOKENS or named["next_tokens"] < MAX_TOKENS,
        )
        checked = self._checked.get(key)
        if checked is None:
            layouts = {n: Layout.of(x) for n, x in tensors.items()}
            checked = (*self._check(layout, layouts, named, order), {})
            self._checked.put(key, checked)
        strategy, seq_axes, batch_axes, calls = checked
        if strategy == "tnd_data_parallel" and _whole_sequences(named, t, tensors) is None:
            strategy = "context_parallel"
        dims = self._dims[layout]
        call = calls.get(strategy)
        if call is None:
            gathered = ()
            if strategy == "context_parallel":
                gathered = tuple(
                    n
                    for n, x in tensors.items()
                    if dims[n][0] == "key" and Layout.of(x).tensor_map[dims[n][1]]
                )
            call = _MeshCall(
                layout=layout,
                mode=named["sparse_mode"],
                mesh=mesh,
                tensors=described,
                order=order,
                seq_axes=seq_axes,
                batch_axes=batch_axes,
                strategy=strategy,
                gathered=gathered,
            )
            calls[strategy] = call
        gathered = call.gathered
        local = dict(named)
        same_value = "value" in tensors and named.get("value") is named.get("key")
        for name, x in tensors.items():
            if same_value and name == "value":
                continue
            side = dims[name][0]
            if name in gathered:
                x = gather(p, x, mesh, seq_axes)
            local[name] = p.to_local(x, grad_placements(p, x, side, call))
        if same_value:
            local["value"] = local["key"]
        return (), local, call

    def _check(self, layout, layouts, named, order):
        """The layout rules (strategies/rules.py) and the family's own: a band with
        sparse_mode=0 cannot be split over the query sequence. Returns (strategy, query-sequence
        axes, batch axes)."""
        dims = {name: self.table.tensors[name][layout] for name in layouts}
        sharding = rules.check(layouts, dims, layout)
        seq_axes = sharding.seq_axes
        if order is not None:
            rules.check_head_tail(layouts, dims, sharding)
        if seq_axes and named["sparse_mode"] == 0:
            for name in ("pre_tokens", "next_tokens"):
                if named[name] < MAX_TOKENS:
                    raise ValueError(
                        f"{name}: a band with sparse_mode=0 cannot be split over the query "
                        "sequence (context parallel); use sparse_mode=3 or replicate the query "
                        "sequence"
                    )
        if not seq_axes:
            return "local", (), sharding.batch_axes
        if layout == "TND" and sharding.keys_sharded and order is None and len(seq_axes) == 1:
            return "tnd_data_parallel", seq_axes, ()
        return "context_parallel", seq_axes, sharding.batch_axes

    # -- output layouts -----------------------------------------------------------------------

    def infer_layout(self, cache_values):
        c = cache_values
        p = _platform.current()
        t = self.table
        first = t.params[0]
        q_dims = t.tensors[first][c.layout]
        q_placements = c.placements(first)
        rows = set(c.seq_axes) | set(c.batch_axes)
        out = []
        for kind in t.outputs:
            if kind[0] == "loss":
                placements = tuple(
                    p.partial() if a in rows else p.replicate() for a in range(len(q_placements))
                )
                out.append(("fixed", c.mesh, placements, (1,)))
            elif kind[0] == "grad":
                name = kind[1]
                placements = c.placements(name)
                side = side_of(t.tensors[name][c.layout])
                if side == "key" and c.strategy == "context_parallel":
                    placements = tuple(
                        p.partial() if a in c.seq_axes else pl for a, pl in enumerate(placements)
                    )
                out.append(("fixed", c.mesh, placements, c.shape(name)))
            else:
                dims = kind[1][c.layout]
                placements = []
                for pl in q_placements:
                    d = p.shard_dim(pl)
                    target = None if d is None else q_dims[d]
                    if target in dims:
                        placements.append(p.shard(dims.index(target)))
                    else:
                        placements.append(p.replicate())
                # The global sizes the local output's batch and sequence dims take (q's).
                sizes = [(seq_dim(dims), c.shape(first)[seq_dim(q_dims)])]
                if "B" in dims:
                    sizes.append((dims.index("B"), c.shape(first)[q_dims.index("B")]))
                out.append(("query", c.mesh, tuple(placements), len(dims), tuple(sizes)))
        return tuple(out), None

    def wrap_outputs(self, outputs, out_layouts):
        p = _platform.current()
        items = (outputs,) if not isinstance(outputs, (tuple, list)) else tuple(outputs)
        wrapped = []
        for out, spec in zip(items, out_layouts, strict=True):
            if spec[0] == "fixed":
                _, mesh, placements, shape = spec
                wrapped.append(p.from_local(out, mesh, placements, tuple(shape)))
                continue
            _, mesh, placements, ndim, sizes = spec
            if out.dim() != ndim:  # an output the call was not asked for: empty
                wrapped.append(
                    p.from_local(out, mesh, tuple(p.replicate() for _ in placements), out.shape)
                )
                continue
            shape = list(out.shape)
            for d, size in sizes:
                shape[d] = size
            wrapped.append(p.from_local(out, mesh, placements, tuple(shape)))
        return wrapped[0] if not isinstance(outputs, (tuple, list)) else tuple(wrapped)

    # -- the local call -----------------------------------------------------------------------

    def get_expand_impl(self, func, infer_result, cache_values):
        return _Local(func, self.table, cache_values)


def _whole_sequences(named, t, tensors):
    """TND data parallel: per shard, the run of sequences [lo, hi) whose query and key tokens
    are exactly the shard's; None when a shard cuts a sequence (or the lengths are missing)."""
    q_ends, k_ends = _ints(named.get(t.lengths[0])), _ints(named.get(t.lengths[1]))
    if q_ends is None or k_ends is None or len(q_ends) != len(k_ends):
        return None
    layout = named[t.layout]
    q_name = next(n for n in tensors if side_of(t.tensors[n][layout]) == "query")
    k_name = next(n for n in tensors if side_of(t.tensors[n][layout]) == "key")
    return whole_sequence_shards(
        [0, *q_ends], [0, *k_ends], Layout.of(tensors[q_name]), Layout.of(tensors[k_name])
    )


@dataclass
class _Piece:
    """One local call: its query rows (a slice or an index along the query sequence), its
    lengths, the key rows it keeps (None for all), and per sequence the keys it keeps and the
    sequence's global key count (for the selection's remap; None when nothing is cut)."""

    rows: object
    qlen: object
    klen: object
    keys: object = None
    kept: object = None  # BSND: [B_local]; TND: per local query row
    total: object = None
    residual: object = None  # compressed keys: the piece's cmp_residual_key (None: the call's)


class _Local:
    """Cuts the rank's call into pieces (one, or two in head-tail order), calls the op per
    piece, and joins the results: query-side outputs concatenated (and put back in the local
    row order), key gradients summed into the whole key tensor, losses summed."""

    def __init__(self, func, table, call: _MeshCall):
        self.func, self.t, self.c = func, table, call
        layout = call.layout
        first = table.params[0]
        q_dims = table.tensors[first][layout]
        self.q_layout = Layout(call.mesh, call.placements(first), call.shape(first))
        self.q_seq = seq_dim(q_dims)
        self.s1 = call.shape(first)[self.q_seq]
        key_name = _first_key(table, call)
        self.s2 = call.shape(key_name)[seq_dim(table.tensors[key_name][layout])]
        self.cp = self.q_layout.num_shards(self.q_seq)
        self.rank = self.q_layout.shard_index(self.q_seq)
        self.rows = self.q_layout.shard_range(self.q_seq)
        self.batch = self.q_layout.shard_range(0) if layout == "BSND" else (0, 0)
        self.dims = {n: (side_of(d[layout]), seq_dim(d[layout])) for n, d in table.tensors.items()}
        # The mask's right bound: causal (sparse_mode 3), or none (a band is refused under CP).
        self.right = 0 if call.mode == 3 else -1

    # the pieces ------------------------------------------------------------------------------

    def _bsnd_pieces(self, qlen, klen, ratio, residual):
        b0, b1 = self.batch
        if self.c.strategy == "local":

            def local(lengths):
                return None if lengths is None else torch.tensor(lengths[b0:b1], dtype=torch.int64)

            return [_Piece(slice(None), local(qlen), local(klen), residual=local(residual))]
        qlen = [self.s1] * (b1 - b0) if qlen is None else qlen[b0:b1]
        klen = [self.s2] * (b1 - b0) if klen is None else klen[b0:b1]
        residual = None if residual is None else residual[b0:b1]
        tokens = _original_tokens(klen, ratio, residual)
        pieces = bsnd_pieces(
            qlen, tokens, self.rows, self.right, self.cp, self.rank, self.c.order, self.s1
        )
        return _calls_in_entries(pieces, ratio, klen, self._bsnd_call)

    @staticmethod
    def _bsnd_call(piece):
        call = _Piece(piece.rows, _int64(piece.q_used), _int64(piece.k_used))
        if piece.cuts_keys:
            call.kept, call.total = _int64(piece.k_used), _int64(piece.k_len)
        return call

    def _tnd_pieces(self, q_ends, k_ends, ratio, residual):
        strategy = self.c.strategy
        if strategy == "local":
            return [_Piece(slice(None), _opt_tensor(q_ends), _opt_tensor(k_ends))]
        if q_ends is None or k_ends is None:
            raise ValueError(f"{self.t.lengths[0]}, {self.t.lengths[1]}: required for layout TND")
        if len(q_ends) != len(k_ends):
            raise ValueError(
                f"{self.t.lengths[1]}: expected {len(q_ends)} entries like {self.t.lengths[0]}, "
                f"got {len(k_ends)}"
            )
        if strategy == "tnd_data_parallel":
            lo, hi = self._run(q_ends, k_ends)
            if hi <= lo:  # a shard without sequences runs one empty sequence
                empty = None if residual is None else _int64([0])
                return [_Piece(slice(None), _int64([0]), _int64([0]), residual=empty)]
            q_base = q_ends[lo - 1] if lo else 0
            k_base = k_ends[lo - 1] if lo else 0
            return [
                _Piece(
                    slice(None),
                    _int64([q_ends[b] - q_base for b in range(lo, hi)]),
                    _int64([k_ends[b] - k_base for b in range(lo, hi)]),
                    residual=None if residual is None else _int64(residual[lo:hi]),
                )
            ]
        q_len = [e - s for s, e in zip([0, *q_ends[:-1]], q_ends, strict=True)]
        k_len = [e - s for s, e in zip([0, *k_ends[:-1]], k_ends, strict=True)]
        tokens = _original_tokens(k_len, ratio, residual)
        pieces = tnd_pieces(
            q_len, tokens, self.rows, self.right, self.cp, self.rank, self.c.order,
            self.t.lengths[0],
        )  # fmt: skip
        return _calls_in_entries(pieces, ratio, k_len, self._tnd_call)

    @staticmethod
    def _tnd_call(piece):
        """The op's lengths are cumulative; keys it does not keep are cut (it has no per-sequence
        key count to stop at), and its selection is remapped to the kept keys."""
        call = _Piece(piece.rows, _int64(piece.q_used).cumsum(0), _int64(piece.k_used).cumsum(0))
        if piece.cuts_keys:
            counts = _int64(piece.q_used)
            call.keys = kept_keys(piece, piece.k_len)
            call.kept = torch.repeat_interleave(_int64(piece.k_used), counts)
            call.total = torch.repeat_interleave(_int64(piece.k_len), counts)
        return call

    def _run(self, q_ends, k_ends):
        """TND data parallel: the rank's whole sequences [lo, hi)."""
        key_name = _first_key(self.t, self.c)
        k_layout = Layout(self.c.mesh, self.c.placements(key_name), self.c.shape(key_name))
        runs = whole_sequence_shards([0, *q_ends], [0, *k_ends], self.q_layout, k_layout)
        if runs is None:
            raise ValueError(
                f"{self.t.lengths[0]}: the sequences changed between the layout check and the call"
            )
        return runs[self.rank]

    # the call --------------------------------------------------------------------------------

    def _natural_keys(self, named):
        """Gathered key-side tensors arrive in the query's shard order: put them back in the
        sequence's natural order."""
        if self.c.order is None or not self.c.gathered:
            return named
        layout = self.c.layout
        cu = None
        if layout == "TND":
            cu = [0, *_ints(named[self.t.lengths[1]])]
        named = dict(named)
        done = {}
        for name in self.c.gathered:
            value = named[name]
            if id(value) in done:
                named[name] = done[id(value)]
                continue
            d = seq_dim(self.t.tensors[name][layout])
            named[name] = natural_order(value, d, self.cp, self.c.order, cu_seqlens=cu)
            done[id(value)] = named[name]
        return named

    def __call__(self, *args, **named):
        t, c = self.t, self.c
        original = named
        named = self._natural_keys(named)
        qlen, klen = _ints(named.get(t.lengths[0])), _ints(named.get(t.lengths[1]))
        ratio = int(named.get("cmp_ratio") or 1)
        residual = _ints(named.get("cmp_residual_key"))
        if c.layout == "BSND":
            pieces = self._bsnd_pieces(qlen, klen, ratio, residual)
        else:
            pieces = self._tnd_pieces(qlen, klen, ratio, residual)
        same_value = "value" in t.tensors and named.get("value") is named.get("key")
        outs = []
        for piece in pieces:
            call = dict(named)
            call[t.lengths[0]], call[t.lengths[1]] = piece.qlen, piece.klen
            if piece.residual is not None:
                call["cmp_residual_key"] = piece.residual
            whole_rows = isinstance(piece.rows, slice) and piece.rows == slice(None)
            if not whole_rows or piece.keys is not None or piece.kept is not None:
                for name, (side, d) in self.dims.items():
                    value = named.get(name)
                    if value is None or (same_value and name == "value"):
                        continue
                    if side == "query" and not whole_rows:
                        value = _take(value, d, piece.rows)
                    elif side == "key" and piece.keys is not None:
                        value = value.index_select(d, piece.keys)
                    if name == t.indices and piece.kept is not None:
                        value = self._drop_unseen(value, piece, named)
                    call[name] = value
                if same_value:
                    call["value"] = call["key"]
            positional_args = [call.pop(n) for n in t.params]
            outs.append(self.func(*positional_args, **call))
        if len(pieces) == 1 and pieces[0].keys is None and isinstance(pieces[0].rows, slice):
            if c.order is None or not c.gathered:
                return outs[0]  # one call on the rank's tensors as they are: nothing to join
        return self._join(outs, pieces, original)

    def _drop_unseen(self, indices, piece, named):
        """Entries pointing at keys the piece does not keep (no local row can see them) become
        -1; entries past the whole sequence stay, for the operator to refuse."""
        block = int(named.get(self.t.block_size, 1)) if self.t.block_size else 1
        shape = (-1,) + (1,) * (indices.dim() - 1)
        kept, total = piece.kept.view(shape), piece.total.view(shape)
        blocks = (total + block - 1) // block
        unseen = (indices.long() * block >= kept) & (indices < blocks)
        return torch.where(unseen, torch.full_like(indices, -1), indices)

    def _join(self, outs, pieces, original):
        t, c = self.t, self.c
        layout = c.layout
        single = not isinstance(outs[0], (tuple, list))
        per_piece = [(o,) if single else tuple(o) for o in outs]
        joined = []
        for i, kind in enumerate(t.outputs):
            parts = [o[i] for o in per_piece]
            if kind[0] == "loss":
                joined.append(sum(parts[1:], parts[0]))
                continue
            if kind[0] == "grad":
                name = kind[1]
                dims = t.tensors[name][layout]
                d = seq_dim(dims)
                if side_of(dims) == "key":
                    joined.append(self._key_grad(parts, pieces, name, original[name], d, original))
                    continue
                joined.append(join_rows(parts, pieces, d))
                continue
            dims = kind[1][layout]
            if parts[0].dim() != len(dims):
                joined.append(parts[0])
                continue
            joined.append(join_rows(parts, pieces, seq_dim(dims)))
        return joined[0] if single else tuple(joined)

    def _key_grad(self, parts, pieces, name, key, d, named):
        """The fused losses' key gradient: each piece's rows scattered into the whole (natural
        order) key tensor and summed, then put in the order the key came in."""
        total = None
        for part, piece in zip(parts, pieces, strict=True):
            if piece.keys is not None:
                full = part.new_zeros(key.shape).index_add(d, piece.keys, part)
            else:
                full = part
            total = full if total is None else total + full
        if self.c.order is not None and name in self.c.gathered:
            cu = None if self.c.layout == "BSND" else [0, *_ints(named[self.t.lengths[1]])]
            total = to_head_tail(total, d, self.cp, self.c.order, cu_seqlens=cu)
        return total


def _original_tokens(entries, ratio, residual):
    """Compressed keys (``cmp_ratio > 1``): each sequence's original token count, in which a
    row's reach is found (``keys_seen``); plain keys as they are."""
    if ratio == 1:
        return entries
    residual = residual or [0] * len(entries)
    return [n * ratio + r for n, r in zip(entries, residual, strict=True)]


def _calls_in_entries(pieces, ratio, entries, make_call):
    """The local calls of pieces found in original tokens (``_in_entries``), each with its
    residual."""
    calls = []
    for piece in pieces:
        piece, residual = _in_entries(piece, ratio, entries)
        calls.append(make_call(piece))
        calls[-1].residual = residual
    return calls


def _in_entries(piece, ratio, entries):
    """A piece found in original tokens, in compressed entries: each sequence keeps the entries
    whose last token its rows reach, and the tokens past them are its residual (None for plain
    keys)."""
    if ratio == 1:
        return piece, None
    reach = piece.k_used
    piece = replace(piece, k_used=[n // ratio for n in reach], k_len=list(entries))
    return piece, _int64([n % ratio for n in reach])


def _first_key(table, call):
    """The first key-side tensor of the call (its key sequence is the call's)."""
    layout = call.layout
    return next(n for n, _pl, _sh in call.tensors if side_of(table.tensors[n][layout]) == "key")


def _opt_tensor(values):
    return None if values is None else _int64(values)
