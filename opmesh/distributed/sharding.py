"""Sharding strategies of the ``torch.ops.opmesh`` operators for DTensor's own dispatch.

Called directly with DTensors, an operator runs wherever a layout rule alone is enough: DTensor
picks one of the strategies below per mesh axis (redistributing inputs to it if they are laid out
otherwise) and calls the operator on the local shards. What needs communication inside the op or
rewritten lengths (context parallel, TND token shards) stays with the ``DFunction`` path of
``opmesh.flash_attn`` and friends; both paths give the same numbers.

Every strategy is per mesh axis: ``(output placements, input placements)``, the inputs listed in
the order DTensor sees them (positional tensors, then keyword tensors in call order).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo, TupleStrategy
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

from .._schema import MAX_TOKENS, UNBOUNDED, positional
from .ops.dsa import TABLES as _DSA
from .ops.flash_attn import DIMS, LSE_DIMS
from .strategies.heads import keeps_gqa_groups

R = Replicate()


def _spec_of(strategy):
    if isinstance(strategy, OpStrategy):
        return strategy.strategies[0].output_spec
    if isinstance(strategy, TupleStrategy):
        return tuple(_spec_of(s) for s in strategy.children)
    return strategy


def _strategy(sharding_fn, op_schema):
    """DTensor's strategy for one call: ``sharding_fn``'s per-axis strategies expanded to the
    whole mesh. Uneven shards are allowed: every strategy here splits dims whose slices are
    independent problems (a batch of 3 over 2 ranks is 2 + 1 sequences)."""
    args = tuple(_spec_of(a) for a in op_schema.args_schema)
    kwargs = {k: _spec_of(v) for k, v in op_schema.kwargs_schema.items()}
    per_axis = [list(out) + list(inp) for out, inp in sharding_fn(*args, **kwargs)]
    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(),
        op_schema,
        per_axis,
        input_index=len(op_schema.op._schema.returns),
        allow_uneven_sharding=True,
    )


def register_sharding(op):
    """Registers ``fn(*args, **kwargs) -> [(output placements, input placements), ...]`` (per
    mesh axis) as ``op``'s DTensor strategy. PyTorch's experimental register_sharding does the
    same but refuses uneven shards. DTensor never redistributes keyword tensors, so a strategy
    lists them only as the caller must already have placed them."""

    def wrapper(fn):
        # Every keyword argument keys DTensor's strategy cache: the layouts, masks and which
        # optional tensors are present all change the strategies.
        keys = [a.name for a in op._schema.arguments if a.kwarg_only]
        info = RuntimeSchemaInfo(100, keys or None, needs_pytree=True)
        DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
            op, partial(_strategy, fn), info
        )
        return fn

    return wrapper


# flash_attn's layout table, shared with its DistributedOp: (batch, sequence, heads) dims of
# q/k/v/out, and the lse's (batch, heads, sequence) dims.
ATTN_DIMS = {layout: dims[:3] for layout, dims in DIMS.items()}


def _is_spec(value) -> bool:
    return hasattr(value, "placements") and hasattr(value, "mesh")


def _inputs(names, args, kwargs, placement_of):
    """The input placement list: positional tensors, then keyword tensors in call order;
    ``placement_of(name)`` gives each one's placement."""
    out = [placement_of(n) if _is_spec(a) else None for n, a in zip(names, args, strict=False)]
    out += [placement_of(n) for n, v in kwargs.items() if _is_spec(v)]
    return out


def _replicated(names, args, kwargs, outputs):
    return ([R] * outputs, _inputs(names, args, kwargs, lambda _n: R))


def _heads_divide(mesh, nq, nkv) -> bool:
    """Whether splitting the heads over any mesh axis (or all of them) keeps every query head
    with its key head (the DistributedOp's rule, per possible split)."""
    return all(keeps_gqa_groups(nq, nkv, m) for m in [*mesh.shape, mesh.size()])


INDEXER = _DSA["dense_lightning_indexer_softmax_lse"].params
INDEXER_LENGTHS = _DSA["dense_lightning_indexer_softmax_lse"].lengths


def _bsnd_dims(dim_name: str) -> dict:
    """Where each of the indexer's tensors has ``dim_name`` in BSND, from its DistributedOp's
    layout table: name -> Shard(dim), or Replicate where it has no such dim."""
    tensors = _DSA["dense_lightning_indexer_softmax_lse"].tensors
    dims = {n: tensors[n]["BSND"] for n in INDEXER}
    return {n: Shard(d.index(dim_name)) if dim_name in d else R for n, d in dims.items()}


@register_sharding(torch.ops.opmesh.dense_lightning_indexer_softmax_lse.default)
def _indexer(query_index, key_index, weights, **kwargs):
    args = (query_index, key_index, weights)
    strategies = [_replicated(INDEXER, args, kwargs, 2)]
    if kwargs.get("layout", "BSND") != "BSND":
        return strategies  # TND token shards need rewritten lengths: the dispatcher's path
    # Data parallel: the batch dim of every tensor, lengths included; outputs [B, N2, S1].
    batch = {**_bsnd_dims("B"), **dict.fromkeys(INDEXER_LENGTHS, Shard(0))}
    strategies.append(([Shard(0), Shard(0)], _inputs(INDEXER, args, kwargs, batch.get)))
    unbounded = all(kwargs.get(n, UNBOUNDED) >= MAX_TOKENS for n in ("pre_tokens", "next_tokens"))
    lengths = any(kwargs.get(n) is not None for n in INDEXER_LENGTHS)
    if kwargs.get("sparse_mode", 3) == 0 and unbounded and not lengths:
        # No mask: query rows are independent and see every key (which key_index, having no
        # S1, keeps whole).
        strategies.append(
            ([Shard(2), Shard(2)], _inputs(INDEXER, args, kwargs, _bsnd_dims("S1").get))
        )
    return strategies


ATTN = positional("flash_attn")
ATTN_BACKWARD = positional("flash_attn_backward")


def _attn_strategies(mesh, names, args, kwargs, outputs, nq, nkv):
    """Replicated, batch-sharded and head-sharded strategies of flash_attn (forward: outputs
    ``out, lse``) or its backward (``dq, dk, dv, dsinks``)."""
    layout = kwargs.get("layout_q", "BSND")
    if kwargs.get("layout_kv", "BSND") != layout or kwargs.get("block_table") is not None:
        return [_replicated(names, args, kwargs, len(outputs))]
    if kwargs.get("metadata") is not None:
        return [_replicated(names, args, kwargs, len(outputs))]  # a plan of the global call
    layout_out = kwargs.get("layout_out", "BSND")
    b, _s, n = ATTN_DIMS[layout]
    ob, _os, on = ATTN_DIMS[layout_out]
    lb, ln, _ls = LSE_DIMS[layout]
    has_lse = kwargs.get("return_softmax_lse", False) or "dq" in outputs
    has_sinks = kwargs.get("sinks") is not None
    strategies = [_replicated(names, args, kwargs, len(outputs))]

    def strategy(tensor_dim, out_dim, lse_dim, lengths, sinks, dsinks):
        by_name = {n_: Shard(tensor_dim) for n_ in ("q", "k", "v", "dout")}
        by_name.update(out=Shard(out_dim), lse=Shard(lse_dim), dlse=Shard(lse_dim), sinks=sinks)
        by_name.update(seqused_q=lengths, seqused_kv=lengths, cu_seqlens_q=R, cu_seqlens_kv=R)
        inputs = _inputs(names, args, kwargs, by_name.get)
        if "dq" in outputs:
            return ([Shard(tensor_dim)] * 3 + [dsinks if has_sinks else R], inputs)
        return ([Shard(out_dim), Shard(lse_dim) if has_lse else R], inputs)

    if b is not None:
        # Data parallel: each rank's sequences; sinks' gradient is a sum over the batch.
        strategies.append(strategy(b, ob, lb, Shard(0), R, Partial()))
    if _heads_divide(mesh, nq, nkv):
        strategies.append(strategy(n, on, ln, R, Shard(0), Shard(0)))
    return strategies


@register_sharding(torch.ops.opmesh.flash_attn.default)
def _flash_attn(q, k, v, **kwargs):
    n = ATTN_DIMS[kwargs.get("layout_q", "BSND")][2]
    heads_kv = k.shape[n] if kwargs.get("block_table") is None else 0
    return _attn_strategies(q.mesh, ATTN, (q, k, v), kwargs, ("out", "lse"), q.shape[n], heads_kv)


@register_sharding(torch.ops.opmesh.flash_attn_backward.default)
def _flash_attn_backward(dout, q, k, v, out, lse, **kwargs):
    n = ATTN_DIMS[kwargs.get("layout_q", "BSND")][2]
    return _attn_strategies(
        q.mesh,
        ATTN_BACKWARD,
        (dout, q, k, v, out, lse),
        kwargs,
        ("dq", "dk", "dv", "dsinks"),
        q.shape[n],
        k.shape[n],
    )


MERGE = positional("merge_attn_states")


@register_sharding(torch.ops.opmesh.merge_attn_states.default)
def _merge(out_a, lse_a, out_b, lse_b, **kwargs):
    layout = kwargs.get("layout", "BSND")
    args = (out_a, lse_a, out_b, lse_b)
    strategies = [_replicated(MERGE, args, kwargs, 2)]
    for out_dim, lse_dim in zip(ATTN_DIMS[layout], LSE_DIMS[layout], strict=True):
        if out_dim is None:
            continue
        placement = {"out_a": Shard(out_dim), "out_b": Shard(out_dim)}
        placement.update(lse_a=Shard(lse_dim), lse_b=Shard(lse_dim))
        strategies.append(
            ([Shard(out_dim), Shard(lse_dim)], _inputs(MERGE, args, kwargs, placement.get))
        )
    return strategies


# The fused KL op's tensor arguments, in schema order (the scale follows them).
KL = positional("dense_lightning_indexer_grad_kl_loss")[:-1]


@register_sharding(torch.ops.opmesh.dense_lightning_indexer_grad_kl_loss.default)
def _kl_loss(*args, **kwargs):
    tensors = args[: len(KL)]
    strategies = [_replicated(KL, tensors, kwargs, 4)]
    if kwargs.get("layout", "BSND") == "BSND":
        # Data parallel: every tensor by its batch dim (the DistributedOp's table; the lengths
        # by their entries); the gradients like their inputs, the loss a sum over the ranks.
        tables = _DSA["dense_lightning_indexer_grad_kl_loss"].tensors
        batch = {n: Shard(dims["BSND"].index("B")) for n, dims in tables.items()}
        batch.update(dict.fromkeys(INDEXER_LENGTHS, Shard(0)))
        outputs = [batch["query_index"], batch["key_index"], batch["weights"], Partial()]
        strategies.append((outputs, _inputs(KL, tensors, kwargs, batch.get)))
    return strategies
