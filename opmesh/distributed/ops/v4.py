"""DeepSeek-V4's operators on DTensors: ``sparse_flash_mla`` and ``compressor``.

``sparse_flash_mla``'s tensors by their named dims: the query-side ``q`` ``[B, S1, N1, D]`` /
``[T1, N1, D]`` with its selections and top-k lengths, the key-side ``ori_kv`` and ``cmp_kv``
(the raw keys and the compressed entries, each its own key sequence), the shared ``sinks``. The
layout rules are the DSA family's (strategies/rules.py): the batch sharded alike, every key
sequence replicated or sharded like the query sequence, heads and head dims replicated. Paged
keys and a ``metadata`` plan (a plan is of one device's call) are refused on a mesh.

Strategies, chosen per call:

* no context parallel: each rank runs its batch slice (BSND lengths sliced alike);
* TND data parallel: the query, raw-key and compressed-key tokens sharded alike over one mesh
  axis with every shard boundary on a sequence boundary in all three: each rank runs its whole
  sequences;
* context parallel: each rank computes its query rows (in head-tail order its two chunks
  apart), sharded key tensors all-gathered over the query sequence's axes (one gather per
  tensor inside ``opmesh.gather_once()``) and put back in natural order. Each sequence keeps
  the keys its local rows can see so that the masks stay where the global call has them: the
  raw keys up to the last local row's diagonal (plus the window's right reach), the compressed
  entries up to the last local row's position in original tokens, the residual recomputed, all
  through the call's ``seqused_*`` and ``cmp_residual_kv``. Selected entries past those keys
  (no local row can see them) become -1.

Outputs take the query's sharding (the lse ``[B, N2, S1, G]`` / ``[N2, T1, G]`` too); the key
tensors' gradients come back summed over the ranks that read them (reduce-scattered when they
were gathered), the sinks' as a ``Partial`` sum over every axis that splits the rows.

``compressor`` runs data parallel: ``x`` ``[B, S, H]`` sharded on the batch (or replicated);
its entries take that sharding and the shared weights (``wkv``, ``wgate``, ``ape``) get
``Partial`` gradients over the batch's axes. Sharded tokens are refused by name: a window may
straddle two ranks, and a TND rank's entry count does not follow the token split. The state
cache (one device's decoding state) is refused on a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import platform as _platform
from ..._schema import defaults, positional
from ..context_parallel import chunk_pair, head_tail_order, keys_seen
from ..distributed_op import DistributedOp
from ..layout import Layout
from ..strategies import description as desc
from ..strategies import rules
from ..strategies.all_gather import bsnd_pieces, gather, join_rows, natural_order, tnd_pieces
from ..strategies.data_parallel import whole_sequence_shards
from ..strategies.description import (
    GROUP_STATS_DIMS,
    KEY_DIMS,
    QUERY_DIMS,
    SELECTION_DIMS,
    CallTensors,
    grad_placements,
    local_lengths,
    seq_dim,
    side_of,
)

_TOPK = {"BSND": ("B", "S1", "N2"), "TND": ("T1", "N2")}
MLA_TENSORS = {
    "q": QUERY_DIMS,
    "ori_kv": KEY_DIMS,
    "cmp_kv": KEY_DIMS,
    "ori_sparse_indices": SELECTION_DIMS,
    "cmp_sparse_indices": SELECTION_DIMS,
    "ori_topk_length": _TOPK,
    "cmp_topk_length": _TOPK,
    "sinks": {"BSND": ("N1",), "TND": ("N1",)},
}
MLA_LENGTHS = (
    "cu_seqlens_q", "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q", "seqused_ori_kv",
    "seqused_cmp_kv", "cmp_residual_kv",
)  # fmt: skip
# Per key tensor: its selection, its cumulative and used lengths.
_KEYS = {
    "ori_kv": ("ori_sparse_indices", "cu_seqlens_ori_kv", "seqused_ori_kv"),
    "cmp_kv": ("cmp_sparse_indices", "cu_seqlens_cmp_kv", "seqused_cmp_kv"),
}


def _named_call(op_name, args, kwargs):
    params = positional(op_name)
    if len(args) > len(params):
        raise ValueError(
            f"{op_name}: expected at most {len(params)} positional arguments, got {len(args)}"
        )
    return {**defaults(op_name), **dict(zip(params, args, strict=False)), **kwargs}


def _dtensors(named, names):
    p = _platform.current()
    tensors = {n: named[n] for n in names if named.get(n) is not None}
    for name, value in tensors.items():
        if not p.is_dtensor(value):
            raise ValueError(
                f"{name}: expected a DTensor like the other inputs, got {type(value).__name__}"
            )
    return tensors


@dataclass(frozen=True, eq=False)
class _MlaCall(CallTensors):
    """What the output layouts and the local call depend on (compared by identity)."""

    layout: str
    mesh: object
    tensors: tuple  # (name, placements, global shape)
    order: str | None
    seq_axes: tuple
    batch_axes: tuple
    strategy: str  # "local", "tnd_data_parallel" or "context_parallel"
    gathered: tuple


class SparseFlashMlaDistributedOp(DistributedOp):
    def __init__(self, op_name: str = "sparse_flash_mla"):
        super().__init__(op_name)

    def preprocess(self, args, kwargs):
        p = _platform.current()
        named = local_lengths(_named_call(self.op_name, args, kwargs), MLA_LENGTHS)
        if named["metadata"] is not None:
            raise ValueError(
                "metadata: a plan describes one device's call; on a device mesh each rank "
                "balances its own rows (omit metadata)"
            )
        for name in ("ori_kv_scale", "cmp_kv_scale"):
            if named.get(name) is not None:
                raise ValueError(
                    f"{name}: a quantized kv is read on one device; on a device mesh pass ori_kv "
                    "and cmp_kv in the query's dtype"
                )
        layout, key_layout = named["layout_q"], named["layout_kv"]
        if key_layout == "PA_BBND" or any(
            named[n] is not None for n in ("ori_block_table", "cmp_block_table")
        ):
            raise ValueError(
                "layout_kv: paged keys (PA_BBND) are not supported on a device mesh; pass the "
                "keys in the query's layout"
            )
        if layout not in ("BSND", "TND"):
            raise ValueError(f"layout_q: expected 'BSND' or 'TND', got {layout!r}")
        if key_layout != layout:
            raise ValueError(
                f"layout_kv: on a mesh the keys take the query's layout {layout!r}, got "
                f"{key_layout!r}"
            )
        tensors = _dtensors(named, MLA_TENSORS)
        layouts = {n: Layout.of(x) for n, x in tensors.items()}
        dims = {n: MLA_TENSORS[n][layout] for n in tensors}
        sharding = rules.check(layouts, dims, layout)
        order = head_tail_order()
        seq_axes = sharding.seq_axes
        strategy = "local"
        if seq_axes:
            if order is not None:
                rules.check_head_tail(layouts, dims, sharding)
            strategy = "context_parallel"
            if (
                layout == "TND"
                and order is None
                and _whole_sequences(named, layouts, len(seq_axes)) is not None
            ):
                strategy = "tnd_data_parallel"
            if strategy == "context_parallel":
                _check_cuttable(named)
                if layout == "TND" and named["seqused_q"] is not None:
                    raise ValueError(
                        "seqused_q: TND context parallel takes each sequence's query tokens "
                        "from cu_seqlens_q; omit seqused_q"
                    )
        elif order is not None:
            rules.check_head_tail(layouts, dims, sharding)
        gathered = ()
        if strategy == "context_parallel":
            gathered = tuple(
                n for n in _KEYS if n in layouts and layouts[n].tensor_map[seq_dim(dims[n])]
            )
        call = _MlaCall(
            layout, p.mesh_of(tensors["q"]),
            tuple((n, p.placements_of(x), p.global_shape(x)) for n, x in tensors.items()),
            order, seq_axes, sharding.batch_axes, strategy, gathered,
        )  # fmt: skip
        local = dict(named)
        for name, x in tensors.items():
            if name in gathered:
                x = gather(p, x, call.mesh, seq_axes)
            side = side_of(dims[name])
            local[name] = p.to_local(x, grad_placements(p, x, side, call))
        return (), local, call

    def infer_layout(self, cache_values):
        c = cache_values
        return (_query_output(c, "q", QUERY_DIMS), _query_output(c, "q", GROUP_STATS_DIMS)), None

    def wrap_outputs(self, outputs, out_layouts):
        return _wrap_query_outputs(outputs, out_layouts)

    def get_expand_impl(self, func, infer_result, cache_values):
        return _MlaLocal(func, cache_values)


def _query_output(c, first, dims_by_layout):
    """An output of query-side ``dims`` taking ``first``'s batch and sequence sharding."""
    p = _platform.current()
    q_dims = MLA_TENSORS[first][c.layout]
    dims = dims_by_layout[c.layout]
    placements = []
    for pl in c.placements(first):
        d = p.shard_dim(pl)
        target = None if d is None else q_dims[d]
        placements.append(p.shard(dims.index(target)) if target in dims else p.replicate())
    sizes = [(seq_dim(dims), c.shape(first)[seq_dim(q_dims)])]
    if "B" in dims:
        sizes.append((dims.index("B"), c.shape(first)[q_dims.index("B")]))
    return (c.mesh, tuple(placements), len(dims), tuple(sizes))


def _wrap_query_outputs(outputs, out_layouts):
    p = _platform.current()
    single = not isinstance(outputs, (tuple, list))
    items = (outputs,) if single else tuple(outputs)
    wrapped = []
    for out, (mesh, placements, ndim, sizes) in zip(items, out_layouts, strict=True):
        if out.dim() != ndim:  # an output the call was not asked for (the lse's scalar)
            replicated = tuple(p.replicate() for _ in placements)
            wrapped.append(p.from_local(out, mesh, replicated, out.shape))
            continue
        shape = list(out.shape)
        for d, size in sizes:
            shape[d] = size
        wrapped.append(p.from_local(out, mesh, placements, tuple(shape)))
    return wrapped[0] if single else tuple(wrapped)


def _check_cuttable(named):
    """Context parallel keeps each row's keys by cutting the sequence's keys after the last
    local row's reach: a mask aligned to the diagonal with no right bound cannot be cut so."""
    mode, left, right = named["ori_mask_mode"], named["ori_win_left"], named["ori_win_right"]
    if named["ori_kv"] is not None and mode == 4 and right < 0 <= left:
        raise ValueError(
            "ori_win_right: a window bounded on the left only cannot be split over the query "
            "sequence (context parallel); bound it on the right or replicate the query sequence"
        )


def _right_bound(named) -> int:
    """The raw keys' mask right of the diagonal: 0 causal, the window's reach, -1 none."""
    mode = named["ori_mask_mode"]
    if mode == 3:
        return 0
    if mode == 4 and named["ori_win_right"] >= 0:
        return named["ori_win_right"]
    return -1


def _whole_sequences(named, layouts, axes):
    """TND data parallel: the query, raw-key and compressed-key tokens sharded alike with every
    shard boundary on a sequence boundary; per shard the run of sequences [lo, hi), or None."""
    if axes != 1:
        return None
    q = layouts["q"]
    cu_q = desc.ints(named["cu_seqlens_q"])
    runs = None
    for key, (_, cu_name, _) in _KEYS.items():
        if key not in layouts:
            continue
        if not layouts[key].tensor_map[0]:
            return None
        found = whole_sequence_shards(cu_q, desc.ints(named[cu_name]), q, layouts[key])
        if found is None or (runs is not None and found != runs):
            return None
        runs = found
    return runs


@dataclass
class _MlaPiece:
    rows: object  # the piece's query rows along the rank's query sequence
    lengths: dict  # the local call's length arguments
    kept: dict  # key tensor -> per local row's sequence, the keys kept (None: all)
    total: dict  # key tensor -> per local row's sequence, the sequence's keys


class _MlaLocal:
    """The rank's call, cut into pieces (one, or two in head-tail order) whose lengths keep
    every row's global keys; the pieces' outputs are joined in the rank's row order."""

    def __init__(self, func, call: _MlaCall):
        self.func, self.c = func, call
        self.q_layout = Layout(call.mesh, call.placements("q"), call.shape("q"))
        self.q_seq = 1 if call.layout == "BSND" else 0
        self.cp = self.q_layout.num_shards(self.q_seq)
        self.rank = self.q_layout.shard_index(self.q_seq)

    def __call__(self, q, **named):
        c = self.c
        named = self._natural_keys(named)
        if c.strategy == "local":
            return self.func(q, **self._batch_slice(named))
        if c.strategy == "tnd_data_parallel":
            return self.func(q, **self._whole_sequences(named))
        pieces = self._bsnd_pieces(named) if c.layout == "BSND" else self._tnd_pieces(named)
        outs = [self._run(q, named, piece) for piece in pieces]
        lse_rows = 2 if c.layout == "BSND" else 1
        out = join_rows([o[0] for o in outs], pieces, self.q_seq)
        lse = outs[0][1]
        if lse.dim() > 0:
            lse = join_rows([o[1] for o in outs], pieces, lse_rows)
        return out, lse

    # -- strategies without cutting -------------------------------------------------------

    def _batch_slice(self, named):
        if self.c.layout != "BSND" or not self.c.batch_axes:
            return named
        return _per_sequence_slice(dict(named), *self.q_layout.shard_range(0))

    def _whole_sequences(self, named):
        layouts = {n: Layout(self.c.mesh, pl, sh) for n, pl, sh in self.c.tensors}
        runs = _whole_sequences(named, layouts, 1)
        if runs is None:
            raise ValueError(
                "cu_seqlens_q: the sequences changed between the layout check and the call"
            )
        lo, hi = runs[self.rank]
        named = dict(named)
        for name in ("cu_seqlens_q", "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv"):
            cu = desc.ints(named[name])
            if cu is not None:
                named[name] = desc.int64([v - cu[lo] for v in cu[lo : hi + 1]])
        return _per_sequence_slice(named, lo, hi)

    # -- context parallel ---------------------------------------------------------------------

    def _natural_keys(self, named):
        if self.c.order is None or not self.c.gathered:
            return named
        named = dict(named)
        for name in self.c.gathered:
            d = 1 if self.c.layout == "BSND" else 0
            cu = desc.ints(named[_KEYS[name][1]]) if self.c.layout == "TND" else None
            named[name] = natural_order(named[name], d, self.cp, self.c.order, cu_seqlens=cu)
        return named

    def _sequences(self, named):
        """Per sequence (the rank's batch slice in BSND): its query rows, raw keys, compressed
        entries (None for an absent key tensor) and the entries' residual."""
        c = self.c
        present = {n for n, _, _ in c.tensors}
        if c.layout == "BSND":
            b0, b1 = self.q_layout.shard_range(0)

            def lengths(name, tensor):
                values = desc.ints(named[name])
                return [c.shape(tensor)[1]] * (b1 - b0) if values is None else values[b0:b1]

            residual = desc.ints(named["cmp_residual_kv"])
            residual = [0] * (b1 - b0) if residual is None else residual[b0:b1]
        else:

            def lengths(name, tensor):
                values = desc.ints(named[name])
                if values is not None:
                    return values
                cu = desc.ints(named["cu_seqlens_q" if tensor == "q" else _KEYS[tensor][1]])
                return [e - s for s, e in zip(cu, cu[1:], strict=False)]

            residual = desc.ints(named["cmp_residual_kv"])
            if residual is None:
                residual = [0] * (len(desc.ints(named["cu_seqlens_q"])) - 1)
        q_len = lengths("seqused_q", "q")
        ori = lengths("seqused_ori_kv", "ori_kv") if "ori_kv" in present else None
        cmp = lengths("seqused_cmp_kv", "cmp_kv") if "cmp_kv" in present else None
        return q_len, ori, cmp, residual

    def _cut(self, named, q_len, ori, cmp, residual, spans):
        """The lengths of a piece whose rows of sequence b are its rows [lo, hi), and the keys
        each sequence keeps."""
        right = _right_bound(named)
        ratio = named["cmp_ratio"]
        q_used = [hi - lo for lo, hi in spans]
        lengths, kept, total = {}, {}, {}
        if ori is not None:
            kept["ori_kv"] = [
                keys_seen(hi, ql, kl, right) if hi > lo else 0
                for (lo, hi), ql, kl in zip(spans, q_len, ori, strict=True)
            ]
            total["ori_kv"] = ori
            lengths["seqused_ori_kv"] = kept["ori_kv"]
        if cmp is not None:
            if named["cmp_mask_mode"] == 3:
                seen = [
                    keys_seen(hi, ql, kl * ratio + r, 0) if hi > lo else 0
                    for (lo, hi), ql, kl, r in zip(spans, q_len, cmp, residual, strict=True)
                ]
                kept["cmp_kv"] = [s // ratio for s in seen]
                lengths["cmp_residual_kv"] = [s % ratio for s in seen]
            else:
                kept["cmp_kv"] = list(cmp)
                lengths["cmp_residual_kv"] = list(residual)
            total["cmp_kv"] = cmp
            lengths["seqused_cmp_kv"] = kept["cmp_kv"]
        return q_used, lengths, kept, total

    def _bsnd_pieces(self, named):
        q_len, ori, cmp, residual = self._sequences(named)
        pieces = []
        s1 = self.c.shape("q")[1]
        for piece in bsnd_pieces(q_len, q_len, self.q_layout.shard_range(1), -1, self.cp,
                                 self.rank, self.c.order, s1):  # fmt: skip
            spans = [(piece.start, piece.start + used) for used in piece.q_used]
            q_used, lengths, kept, total = self._cut(named, q_len, ori, cmp, residual, spans)
            lengths["seqused_q"] = q_used
            pieces.append(_MlaPiece(piece.rows, lengths, kept, total))
        return pieces

    def _tnd_pieces(self, named):
        q_len, ori, cmp, residual = self._sequences(named)
        shard = self.q_layout.shard_range(0)
        raw = tnd_pieces(q_len, q_len, shard, -1, self.cp, self.rank, self.c.order,
                         "cu_seqlens_q")  # fmt: skip
        chunks = [None] if self.c.order is None else chunk_pair(self.rank, self.cp, self.c.order)
        pieces = []
        for piece, chunk in zip(raw, chunks, strict=True):
            if chunk is None:
                spans = _spans_in(q_len, shard)
            else:
                parts = 2 * self.cp
                spans = [(chunk * (n // parts), (chunk + 1) * (n // parts)) for n in q_len]
            q_used, lengths, kept, total = self._cut(named, q_len, ori, cmp, residual, spans)
            lengths["cu_seqlens_q"] = [0, *torch.tensor(q_used).cumsum(0).tolist()]
            # The sequence of each local row, for the selections' remap.
            owner = torch.repeat_interleave(torch.arange(len(q_used)), desc.int64(q_used))
            kept = {n: desc.int64(v)[owner] for n, v in kept.items()}
            total = {n: desc.int64(v)[owner] for n, v in total.items()}
            pieces.append(_MlaPiece(piece.rows, lengths, kept, total))
        return pieces

    def _run(self, q, named, piece):
        call = dict(named)
        for name, values in piece.lengths.items():
            call[name] = desc.int64(values)
        q_dim = self.q_seq
        rows = piece.rows
        whole = isinstance(rows, slice) and rows == slice(None)
        if not whole:
            q = desc.take_rows(q, q_dim, rows)
        for key, (selection, _, _) in _KEYS.items():
            for name in (selection, selection.replace("sparse_indices", "topk_length")):
                value = call.get(name)
                if value is None:
                    continue
                if not whole:
                    value = desc.take_rows(value, q_dim, rows)
                if name == selection and key in piece.kept:
                    value = _drop_unseen(value, piece, key, self.c.layout)
                call[name] = value
        return self.func(q, **call)


def _per_sequence_slice(named, lo, hi):
    """``named`` with its per-sequence lengths cut to sequences [lo, hi)."""
    for name in ("seqused_q", "seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv"):
        values = desc.ints(named[name])
        if values is not None:
            named[name] = desc.int64(values[lo:hi])
    return named


def _spans_in(q_len, shard):
    """Per sequence of ``q_len`` query tokens, the rows [lo, hi) of it in the token shard
    ``[t0, t1)``."""
    t0, t1 = shard
    spans, start = [], 0
    for n in q_len:
        lo, hi = max(start, t0), min(start + n, t1)
        spans.append((lo - start, hi - start) if hi > lo else (0, 0))
        start += n
    return spans


def _drop_unseen(indices, piece, key, layout):
    """Selected entries past a sequence's kept keys but within its keys become -1 (no local row
    can see them); entries past all its keys stay, for the operator to refuse."""
    kept, total = piece.kept[key], piece.total[key]
    if layout == "BSND":
        kept, total = desc.int64(kept).view(-1, 1, 1, 1), desc.int64(total).view(-1, 1, 1, 1)
    else:
        kept, total = kept.view(-1, 1, 1), total.view(-1, 1, 1)
    unseen = (indices.long() >= kept) & (indices.long() < total)
    return torch.where(unseen, torch.full_like(indices, -1), indices)


# -- compressor ----------------------------------------------------------------------------------

_X = {"BSND": ("B", "S1", "H"), "TND": ("T1", "H")}
COMPRESSOR_TENSORS = {
    "x": _X,
    "wkv": {"BSND": ("W", "H"), "TND": ("W", "H")},
    "wgate": {"BSND": ("W", "H"), "TND": ("W", "H")},
    "ape": {"BSND": ("R", "W"), "TND": ("R", "W")},
}


class CompressorDistributedOp(DistributedOp):
    def __init__(self, op_name: str = "compressor"):
        super().__init__(op_name)

    def preprocess(self, args, kwargs):
        p = _platform.current()
        named = local_lengths(_named_call(self.op_name, args, kwargs), ("cu_seqlens", "seqused"))
        state = named["state_cache"]
        if p.is_dtensor(state) or (state is not None and state.shape[0] > 0):
            raise ValueError(
                "state_cache: a state cache is one device's decoding state; on a device mesh "
                "the compressor runs without one (pass None)"
            )
        if named["start_pos"] is not None:
            raise ValueError("start_pos: on a device mesh every sequence starts at position 0")
        if named.get("projections") is not None:
            raise ValueError(
                "projections: on a device mesh the compressor keeps each rank's projections for "
                "the backward itself (pass None)"
            )
        tensors = _dtensors(named, COMPRESSOR_TENSORS)
        layout = "TND" if len(p.global_shape(tensors["x"])) == 2 else "BSND"
        layouts = {n: Layout.of(x) for n, x in tensors.items()}
        dims = {n: COMPRESSOR_TENSORS[n][layout] for n in tensors}
        sharding = rules.check(layouts, dims, layout)
        if sharding.seq_axes:
            raise ValueError(
                f"x: dim {seq_dim(dims['x'])} (its tokens) is sharded over mesh axes "
                f"{layouts['x'].axes_text(seq_dim(dims['x']))}; the compressor runs data "
                "parallel (x [B, S, H] sharded on the batch): its windows, and the number of "
                "entries each rank makes, need whole sequences"
            )
        call = _MlaCall(
            layout, p.mesh_of(tensors["x"]),
            tuple((n, p.placements_of(v), p.global_shape(v)) for n, v in tensors.items()),
            None, (), sharding.batch_axes, "local", (),
        )  # fmt: skip
        local = dict(named)
        for name, x in tensors.items():
            local[name] = p.to_local(x, grad_placements(p, x, side_of(dims[name]), call))
        if sharding.batch_axes and named["seqused"] is not None:
            b0, b1 = layouts["x"].shard_range(0)
            local["seqused"] = desc.int64(desc.ints(named["seqused"])[b0:b1])
        return (), local, call

    def infer_layout(self, cache_values):
        c = cache_values
        p = _platform.current()
        placements = c.placements("x")
        sizes = ((0, c.shape("x")[0]),) if c.layout == "BSND" else ()
        ndim = 3 if c.layout == "BSND" else 2
        replicated = tuple(p.replicate() for _ in placements)
        return ((c.mesh, placements if c.batch_axes else replicated, ndim, sizes),), None

    def wrap_outputs(self, outputs, out_layouts):
        return _wrap_query_outputs(outputs, out_layouts)
