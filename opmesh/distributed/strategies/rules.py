"""The layout rules every strategy starts from, over the tensors' named dims.

An operator's tensors are given with their named dims (``description.py``); the first is the
reference, a query-side tensor. The rules:

* one mesh, the tensor's rank, no ``Partial`` placement;
* the batch ``B`` sharded alike in every tensor that has one;
* the query sequence (``S1`` / ``T1``) sharded alike in every query-side tensor;
* a key sequence (``S2`` / ``T2``) replicated, or sharded exactly like the query sequence;
* heads (``N1``, ``N2``) replicated, unless the operator takes head parallel: then the query
  heads over at most one mesh axis, the key heads sharded alike or replicated there, and no group
  of query heads cut from its key head;
* every other dim (head dims, top-k, ...) replicated.

A dim sharded where it may not be is reported before one that is missing a sharding; every
error names the tensor, the dim and its name, and the mesh axes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .description import KEY_SEQ, QUERY_SEQ, seq_dim
from .heads import keeps_gqa_groups

HEADS = ("N1", "N2")


@dataclass(frozen=True)
class Sharding:
    """What the rules found: the mesh axes of the query sequence, of the batch and of the query
    heads, whether some key sequence is sharded, and whether the key heads are replicated while
    the query heads are sharded."""

    seq_axes: tuple
    batch_axes: tuple
    heads_axes: tuple
    keys_sharded: bool
    kv_heads_replicated: bool


def refuse(name, lay, dims, d, why):
    """Raises the rules' error for dim ``d`` (named ``dims[d]``) of ``name``'s layout."""
    where = (
        f"is sharded over mesh axis {lay.axes_text(d)}" if lay.tensor_map[d] else "is not sharded"
    )
    raise ValueError(f"{name}: dim {d} ({dims[d]}) {where}; {why}")


def check(layouts: dict, dims: dict, layout: str, *, head_parallel: bool = False) -> Sharding:
    """Checks ``layouts`` (name -> Layout, the reference first) whose named dims are ``dims``
    (name -> tuple of dim names) in the call's ``layout`` against the rules."""
    first_name = next(iter(layouts))
    first = layouts[first_name]
    for name, lay in layouts.items():
        if lay.mesh != first.mesh:
            raise ValueError(f"{name}: must be on the same device mesh as {first_name}")
        if lay.ndim != len(dims[name]):
            raise ValueError(
                f"{name}: expected a {len(dims[name])}-D DTensor [{', '.join(dims[name])}] for "
                f"layout {layout}, got {lay.ndim}-D with global shape {tuple(lay.shape)}"
            )
        partial = lay.partial_axes()
        if partial:
            raise ValueError(
                f"{name}: Partial placement on mesh axis {lay.axis_names[partial[0]]!r} is not "
                "supported; reduce it (redistribute to Replicate or Shard) first"
            )
    first_dims = dims[first_name]
    q_seq = seq_dim(first_dims)
    seq_axes = tuple(first.tensor_map[q_seq])
    batch_axes = tuple(first.tensor_map[first_dims.index("B")]) if "B" in first_dims else ()
    heads_axes = ()
    if head_parallel and "N1" in first_dims:
        heads_axes = tuple(first.tensor_map[first_dims.index("N1")])
    kv_heads_replicated = bool(heads_axes) and all(
        not lay.tensor_map[dims[n].index("N2")] for n, lay in layouts.items() if "N2" in dims[n]
    )
    reference = {
        "B": (batch_axes, f"the batch must be sharded like {first_name}'s"),
        "query": (seq_axes, f"the query sequence must be sharded like {first_name}'s"),
    }
    keys_sharded = False
    for missing in (False, True):
        for name, lay in layouts.items():
            for d, axes in enumerate(lay.tensor_map):
                if bool(axes) == missing:
                    continue
                dim = dims[name][d]
                axes = tuple(axes)
                kind = "query" if dim in QUERY_SEQ else dim
                if kind in reference:
                    want, why = reference[kind]
                    if axes != want:
                        where = first_dims.index(dim) if dim in first_dims else q_seq
                        refuse(
                            name, lay, dims[name], d, f"{why} (mesh axis {first.axes_text(where)})"
                        )
                elif dim in KEY_SEQ and axes:
                    if axes != seq_axes:
                        refuse(
                            name, lay, dims[name], d,
                            "the key sequence must be replicated or sharded like the query "
                            f"sequence of {first_name} (mesh axis {first.axes_text(q_seq)})",
                        )  # fmt: skip
                    keys_sharded = True
                elif dim in HEADS and head_parallel:
                    _check_heads(name, lay, dims[name], d, axes, heads_axes, kv_heads_replicated)
                elif axes and dim not in KEY_SEQ:
                    refuse(name, lay, dims[name], d, "it must be replicated")
    if heads_axes and not kv_heads_replicated:
        _check_groups(layouts, dims, first_name, heads_axes)
    return Sharding(seq_axes, batch_axes, heads_axes, keys_sharded, kv_heads_replicated)


def _check_heads(name, lay, dims, d, axes, heads_axes, kv_heads_replicated):
    if dims[d] == "N1" or not kv_heads_replicated:
        if axes != heads_axes:
            refuse(
                name, lay, dims, d,
                "the heads must be sharded like the query heads, or the key heads replicated "
                "while the query heads are sharded",
            )  # fmt: skip
    if dims[d] == "N1" and len(axes) > 1:
        refuse(name, lay, dims, d, "heads may be sharded over one mesh axis only")


def _check_groups(layouts, dims, first_name, heads_axes):
    """No group of query heads cut from its key head."""
    first = layouts[first_name]
    n1 = dims[first_name].index("N1")
    key = next((n for n in layouts if "N2" in dims[n]), None)
    if key is None:
        return
    shards = first.num_shards(n1)
    nq, nkv = first.shape[n1], layouts[key].shape[dims[key].index("N2")]
    if not keeps_gqa_groups(nq, nkv, shards):
        refuse(
            first_name, first, dims[first_name], n1,
            f"splitting {nq} query heads and {nkv} key heads {shards} ways would cut a group of "
            "query heads from its key head",
        )  # fmt: skip


def check_head_tail(layouts: dict, dims: dict, sharding: Sharding, name: str = "head_tail_cp"):
    """Head-tail order: the query sequence sharded, and every sharded sequence dim a multiple of
    2 * cp (TND sequences are checked one by one when the call cuts them)."""
    first_name = next(iter(layouts))
    first = layouts[first_name]
    if not sharding.seq_axes:
        raise ValueError(
            f"{name}: needs {first_name}'s query sequence sharded for context parallelism"
        )
    cp = first.num_shards(seq_dim(dims[first_name]))
    for tensor, lay in layouts.items():
        d = seq_dim(dims[tensor])
        if d is not None and lay.tensor_map[d] and lay.shape[d] % (2 * cp):
            raise ValueError(
                f"{tensor}: dim {d} ({dims[tensor][d]}) has size {lay.shape[d]}, not a multiple "
                f"of 2 * cp = {2 * cp}, as head_tail_cp needs"
            )
