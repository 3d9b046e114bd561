"""The indexer's KL loss on DTensors: one class serving two ops.

* ``indexer_kl_loss`` (the DFunction behind :func:`opmesh.indexer_kl_loss`): returns the loss;
  its backward gives ``query_index``, ``key_index`` and ``weights`` their gradients.
* ``dense_lightning_indexer_grad_kl_loss`` (the fused operator): returns
  ``(d_query_index, d_key_index, d_weights, loss)``.

The layout rules are the indexer's (opmesh/distributed/ops/indexer.py), applied to every tensor
of the call. The query-side tensors (``query_index``, ``weights``, ``query``, ``query_rope``, the
two pairs of softmax statistics) share one sharding of the batch dim and of the query sequence
(S1 / T1); the key-side tensors (``key_index``, ``key``, ``key_rope``) share the batch dim's and
are otherwise replicated; heads and head dims are replicated. Context parallel rewrites each
rank's lengths as the indexer does, head-tail order included.

The loss is a sum over query tokens, so it comes back Partial (a sum over ranks) on every mesh
axis that shards the batch or the query sequence, and Replicate on the others. The key-side
gradient is a partial sum on the axes that shard the query sequence: the fused operator returns
``d_key_index`` Partial there, and through autograd ``key_index``'s gradient is reduced by
DTensor.
"""

from __future__ import annotations

import torch

from ... import platform as _platform
from ..._schema import MAX_TOKENS, defaults, positional
from ..context_parallel import head_tail_order
from ..distributed_op import DistributedOp
from ..layout import Layout
from .indexer import _BsndLocal, _TndLocal, local_lengths

# The positional parameters of each op this class serves: the DFunction's, and the operator's
# from its schema.
PARAMETERS = {
    "indexer_kl_loss": (
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
    ),
    "dense_lightning_indexer_grad_kl_loss": positional("dense_lightning_indexer_grad_kl_loss"),
}
# The defaults of both (the DFunction takes the operator's).
DEFAULTS = defaults("dense_lightning_indexer_grad_kl_loss")
# name -> (rank, batch dim, query-sequence dim); key-side tensors have no query-sequence dim.
TENSORS = {
    "BSND": {
        "query_index": (4, 0, 1),
        "weights": (3, 0, 1),
        "query": (4, 0, 1),
        "query_rope": (4, 0, 1),
        "softmax_max": (4, 0, 2),
        "softmax_sum": (4, 0, 2),
        "softmax_max_index": (3, 0, 2),
        "softmax_sum_index": (3, 0, 2),
        "key_index": (4, 0, None),
        "key": (4, 0, None),
        "key_rope": (4, 0, None),
    },
    "TND": {
        "query_index": (3, None, 0),
        "weights": (2, None, 0),
        "query": (3, None, 0),
        "query_rope": (3, None, 0),
        "softmax_max": (3, None, 1),
        "softmax_sum": (3, None, 1),
        "softmax_max_index": (2, None, 1),
        "softmax_sum_index": (2, None, 1),
        "key_index": (3, None, None),
        "key": (3, None, None),
        "key_rope": (3, None, None),
    },
}
KEY_SIDE = ("key_index", "key", "key_rope")


class IndexerKlLossDistributedOp(DistributedOp):
    def __init__(self, op_name: str = "indexer_kl_loss"):
        if op_name not in PARAMETERS:
            raise ValueError(
                f"op_name: IndexerKlLossDistributedOp serves {sorted(PARAMETERS)}, got {op_name!r}"
            )
        super().__init__(op_name)

    def preprocess(self, args, kwargs):
        p = _platform.current()
        params = PARAMETERS[self.op_name]
        if len(args) > len(params):
            raise ValueError(
                f"{self.op_name}: expected at most {len(params)} positional arguments, got "
                f"{len(args)}"
            )
        named = {**DEFAULTS, **dict(zip(params, args, strict=False)), **kwargs}
        named = local_lengths(named)
        layout = named["layout"]
        if layout not in TENSORS:
            raise ValueError(f"layout: expected 'BSND' or 'TND', got {layout!r}")
        tensors = {n: named[n] for n in TENSORS[layout] if named.get(n) is not None}
        for name, value in tensors.items():
            if not p.is_dtensor(value):
                raise ValueError(
                    f"{name}: expected a DTensor like the other inputs, got {type(value).__name__}"
                )
        layouts = {n: Layout.of(x) for n, x in tensors.items()}
        self._check(layout, layouts)
        q_map = layouts["query_index"].tensor_map
        _rank, batch_dim, seq_dim = TENSORS[layout]["query_index"]
        seq_axes = q_map[seq_dim]
        batch_axes = q_map[batch_dim] if batch_dim is not None else ()
        order = head_tail_order()
        if order is not None and not (layout == "BSND" and seq_axes):
            raise ValueError(
                "head_tail_cp: needs layout BSND with query_index's S1 sharded for context "
                "parallelism"
            )
        if seq_axes and named["sparse_mode"] == 0:
            for name in ("pre_tokens", "next_tokens"):
                if named[name] < MAX_TOKENS:
                    raise ValueError(
                        f"{name}: a band with sparse_mode=0 cannot be split over the query "
                        "sequence (context parallel); use sparse_mode=3 or replicate the query "
                        "sequence"
                    )

        def grad_placements(x):
            # A key-side tensor is replicated over the axes that split the query sequence: its
            # gradient on each rank is a partial sum there.
            return tuple(
                p.partial() if axis in seq_axes else pl
                for axis, pl in enumerate(p.placements_of(x))
            )

        local = dict(named)
        for name, x in tensors.items():
            local[name] = p.to_local(x, grad_placements(x) if name in KEY_SIDE else None)
        cache_values = (
            layout,
            named["sparse_mode"],
            layouts["query_index"].mesh,
            tuple((n, lay.placements, lay.shape) for n, lay in layouts.items()),
            order,
            tuple(seq_axes),
            tuple(batch_axes),
        )
        return (), local, cache_values

    @staticmethod
    def _check(layout, layouts):
        first = layouts["query_index"]
        mesh = first.mesh
        for name, lay in layouts.items():
            if lay.mesh != mesh:
                raise ValueError(f"{name}: must be on the same device mesh as query_index")
            rank = TENSORS[layout][name][0]
            if lay.ndim != rank:
                raise ValueError(
                    f"{name}: expected a {rank}-D DTensor for layout {layout}, got {lay.ndim}-D "
                    f"with global shape {lay.shape}"
                )
            partial = lay.partial_axes()
            if partial:
                raise ValueError(
                    f"{name}: Partial placement on mesh axis {lay.axis_names[partial[0]]!r} is "
                    "not supported; reduce it (redistribute to Replicate or Shard) first"
                )
        q_batch, q_seq = TENSORS[layout]["query_index"][1:]
        for name, lay in layouts.items():
            _rank, batch_dim, seq_dim = TENSORS[layout][name]
            for d, axes in enumerate(lay.tensor_map):
                if not axes:
                    continue
                where = f"{name}: dim {d} is sharded over mesh axis {lay.axes_text(d)}"
                if d == batch_dim:
                    if axes != first.tensor_map[q_batch]:
                        raise ValueError(
                            f"{where}; the batch must be sharded like query_index's (mesh axis "
                            f"{first.axes_text(q_batch)})"
                        )
                elif d == seq_dim:
                    if axes != first.tensor_map[q_seq]:
                        raise ValueError(
                            f"{where}; the query sequence must be sharded like query_index's "
                            f"(mesh axis {first.axes_text(q_seq)})"
                        )
                elif name in KEY_SIDE and d == (1 if layout == "BSND" else 0):
                    raise ValueError(
                        f"{where}; keys must be replicated (context parallel shards the queries "
                        "only)"
                    )
                else:
                    raise ValueError(f"{where}; it must be replicated")
        for name, lay in layouts.items():
            batch_dim, seq_dim = TENSORS[layout][name][1:]
            if batch_dim is not None and lay.tensor_map[batch_dim] != first.tensor_map[q_batch]:
                raise ValueError(
                    f"{name}: dim {batch_dim} is not sharded; the batch must be sharded like "
                    f"query_index's (mesh axis {first.axes_text(q_batch)})"
                )
            if seq_dim is not None and lay.tensor_map[seq_dim] != first.tensor_map[q_seq]:
                raise ValueError(
                    f"{name}: dim {seq_dim} is not sharded; the query sequence must be sharded "
                    f"like query_index's (mesh axis {first.axes_text(q_seq)})"
                )

    def infer_layout(self, cache_values):
        _layout, _mode, mesh, tensors, _order, seq_axes, batch_axes = cache_values
        p = _platform.current()
        placements = {n: pl for n, pl, _shape in tensors}
        shapes = {n: shape for n, _pl, shape in tensors}
        rows = set(seq_axes) | set(batch_axes)
        loss = (
            mesh,
            tuple(
                p.partial() if a in rows else p.replicate()
                for a in range(len(placements["query_index"]))
            ),
            (1,),
        )
        if self.op_name == "indexer_kl_loss":
            return (loss,), None
        d_key = tuple(
            p.partial() if axis in seq_axes else pl
            for axis, pl in enumerate(placements["key_index"])
        )
        return (
            (mesh, placements["query_index"], shapes["query_index"]),
            (mesh, d_key, shapes["key_index"]),
            (mesh, placements["weights"], shapes["weights"]),
            loss,
        ), None

    def get_expand_impl(self, func, infer_result, cache_values):
        layout, mode, mesh, tensors, order, _seq, _batch = cache_values
        placements = {n: pl for n, pl, _shape in tensors}
        shapes = {n: shape for n, _pl, shape in tensors}
        q_layout = Layout(mesh, placements["query_index"], shapes["query_index"])
        if layout == "BSND":
            lengths = _BsndLocal(None, q_layout, shapes["key_index"][1], mode, order)
        else:
            lengths = _TndLocal(None, q_layout, shapes["key_index"][0], mode)
        return _KlLocal(func, self.op_name, layout, lengths)


class _KlLocal:
    """Calls the op once per piece of the local query rows (two in head-tail order), each with
    its rewritten lengths, and joins the results: losses and key gradients add, query-side
    gradients are concatenated along the query sequence."""

    def __init__(self, func, op_name, layout, lengths):
        self.func, self.op_name, self.layout, self.lengths = func, op_name, layout, lengths

    def __call__(self, **named):
        tensors = TENSORS[self.layout]
        pieces = self.lengths.pieces(named["actual_seq_qlen"], named["actual_seq_klen"])
        outs = []
        for rows, qlen, klen, keys in pieces:
            call = dict(named, actual_seq_qlen=qlen, actual_seq_klen=klen)
            for name, (_rank, _batch, seq_dim) in tensors.items():
                value = named.get(name)
                if value is None:
                    continue
                if seq_dim is not None and rows != slice(None):
                    index = [slice(None)] * value.dim()
                    index[seq_dim] = rows
                    call[name] = value[tuple(index)]
                elif seq_dim is None and keys is not None:
                    call[name] = value[:keys]
            # By position as far as the op's signature goes (the DFunction's forward takes its
            # parameters by position only), the rest by name.
            args = [call.pop(n) for n in PARAMETERS[self.op_name]]
            outs.append(self.func(*args, **call))
        if self.op_name == "indexer_kl_loss":
            return sum(outs[1:], outs[0])
        key_rows = named["key_index"].shape[0]
        d_query, d_key, d_weights, loss = outs[0]
        for dq, dk, dw, piece_loss in outs[1:]:
            d_query = torch.cat([d_query, dq], dim=tensors["query_index"][2])
            d_weights = torch.cat([d_weights, dw], dim=tensors["weights"][2])
            d_key = d_key + dk
            loss = loss + piece_loss
        if d_key.shape[0] != key_rows:  # keys cut off past the last visible one
            pad = d_key.new_zeros((key_rows - d_key.shape[0], *d_key.shape[1:]))
            d_key = torch.cat([d_key, pad])
        return d_query, d_key, d_weights, loss
