"""An operator's description for the strategies: its tensors' named dims and its lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import platform as _platform

QUERY_SEQ = ("S1", "T1")
KEY_SEQ = ("S2", "T2")

# Named dims per layout that the attention family's tensors share: queries, keys, a selection
# of K keys per query row and key head, and per-row statistics of the G query heads of a group.
QUERY_DIMS = {"BSND": ("B", "S1", "N1", "D"), "TND": ("T1", "N1", "D")}
KEY_DIMS = {"BSND": ("B", "S2", "N2", "D"), "TND": ("T2", "N2", "D")}
SELECTION_DIMS = {"BSND": ("B", "S1", "N2", "K"), "TND": ("T1", "N2", "K")}
GROUP_STATS_DIMS = {"BSND": ("B", "N2", "S1", "G"), "TND": ("N2", "T1", "G")}


@dataclass(frozen=True)
class OpTable:
    """One op's description: the parameters its callable takes by position, its defaults, the
    arguments naming the layouts and lengths, its tensors' named dims per layout, and its
    outputs (``("query", dims)``, ``("grad", input)``, or ``("loss",)``)."""

    params: tuple
    defaults: dict
    layout: str
    key_layout: str | None
    lengths: tuple  # (query lengths, key lengths) argument names
    tensors: dict  # name -> {layout: dims}
    outputs: tuple
    indices: str | None = None  # the selection argument (remapped per piece)
    block_size: str | None = None  # the argument giving the selection's block size


def side_of(dims) -> str:
    """``"query"``, ``"key"`` or ``"shared"`` (neither sequence: replicated everywhere)."""
    if any(d in QUERY_SEQ for d in dims):
        return "query"
    if any(d in KEY_SEQ for d in dims):
        return "key"
    return "shared"


def seq_dim(dims) -> int | None:
    """The position of a tensor's sequence dim (query or key), None when it has none."""
    for i, d in enumerate(dims):
        if d in QUERY_SEQ or d in KEY_SEQ:
            return i
    return None


def local_lengths(kwargs, names):
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


def partial_where_replicated(p, x, axes):
    """``x``'s placements with ``Partial`` on each of ``axes`` where ``x`` is replicated: each
    rank's gradient of an input replicated over an axis that splits the rows it computes is a
    partial sum there (DTensor sums it, or reduce-scatters it back for gathered inputs)."""
    axes = set(axes)
    return tuple(
        p.partial() if axis in axes and p.shard_dim(pl) is None else pl
        for axis, pl in enumerate(p.placements_of(x))
    )


def grad_placements(p, x, side, call):
    """The placements ``x``'s local gradient is declared with (None: ``x``'s own): a key-side
    tensor replicated over an axis that splits the query rows (``call.seq_axes``) gets a partial
    gradient there; a shared one (sinks, weights) over the batch's axes (``call.batch_axes``)
    too."""
    if side == "query" or not (call.seq_axes or (side == "shared" and call.batch_axes)):
        return None
    axes = set(call.seq_axes) | (set(call.batch_axes) if side == "shared" else set())
    return partial_where_replicated(p, x, axes)


def fail_sharded(name, lay, dim, why):
    """Refuses ``name``'s sharding of ``dim`` (a ``Layout``), saying which mesh axes shard it
    and why that cannot be served."""
    raise ValueError(f"{name}: dim {dim} is sharded over mesh axes {lay.axes_text(dim)}; {why}")


class CallTensors:
    """For a frozen dataclass with ``tensors``, a tuple of (name, placements, global shape): the
    lookups by name."""

    def placements(self, name):
        return next(pl for n, pl, _ in self.tensors if n == name)

    def shape(self, name):
        return next(sh for n, _, sh in self.tensors if n == name)


def ints(value):
    """A length argument (tensor, list or None) as a list of ints (or None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.tolist()]
    return [int(v) for v in value]


def int64(values):
    return torch.tensor(values, dtype=torch.int64)


def take_rows(value, d, rows):
    """``value``'s rows ``rows`` (a slice or an index) along dim ``d``."""
    if isinstance(rows, slice):
        index = [slice(None)] * value.dim()
        index[d] = rows
        return value[tuple(index)]
    return value.index_select(d, rows)
