"""Masks of transformers models read into packed sequences, shared by the attention functions
of :mod:`opmesh.integrations.transformers` and :mod:`opmesh.integrations.deepseek_v4`."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """The boolean ``[B, Sq, Skv]`` visibility of a 4-D boolean or additive mask."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(
            f"attention_mask: expected a [B, 1, q, kv] mask, got shape {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        visible = mask == 0
        hidden = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((visible | hidden).all()):
            raise ValueError(
                "attention_mask: an additive mask with values other than 0 and the dtype's "
                "minimum is a bias, which opmesh attention does not take"
            )
        mask = visible
    return mask[:, 0]


class _Plan(NamedTuple):
    q_batch: torch.Tensor  # the batch row and position of each packed query
    q_pos: torch.Tensor
    k_batch: torch.Tensor
    k_pos: torch.Tensor
    cu_q: torch.Tensor  # int32 cumulative counts per sequence
    cu_k: torch.Tensor
    q_seq: torch.Tensor  # the sequence of each packed query
    whole_rows: bool  # every row is one sequence of all its query and key slots


_last_plan: list = []  # one entry: (mask ref, key, plan); every layer of a forward shares the mask


def _plan(mask, batch, causal, window, position_ids) -> _Plan | None:
    """The packed sequences of the mask, or None if it is not the causal / windowed / full
    pattern over padded or packed sequences."""
    # Layers take views of one mask (the attention and the DSA indexer slice it apart): the
    # cache holds the tensor the views share, and the key the view's geometry.
    root = mask if mask._base is None else mask._base
    key = (root._version, mask.shape, mask.stride(), mask.storage_offset(), batch, causal, window)
    key += (id(position_ids),)
    if _last_plan and _last_plan[0][0]() is root and _last_plan[0][1] == key:
        return _last_plan[0][2]
    visible = mask.expand(batch, *mask.shape[1:])
    plan = _read_sequences(visible, causal, window, None)
    if plan is None and position_ids is not None and visible.shape[1] == visible.shape[2]:
        plan = _read_sequences(visible, causal, window, _packed(position_ids, batch))
    _last_plan[:] = [(weakref.ref(root), key, plan)]
    return plan


def _packed(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """Sequence numbers within each row: a sequence starts where the position ids do not step
    by one (packed sequences restart them)."""
    positions = position_ids.expand(batch, -1)
    steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    return (steps != 1).cumsum(-1)


def _read_sequences(visible, causal, window, segment) -> _Plan | None:
    """The sequences of a ``[B, Sq, Skv]`` visibility: the real queries and keys of each batch
    row (and packed segment), in order, if the visibility is exactly the pattern over them."""
    batch, q_len, kv_len = visible.shape
    q_real, k_real = visible.any(-1), visible.any(-2)
    rows = torch.arange(batch, device=visible.device)[:, None] * (kv_len + 1)
    # A segment (packing) numbers query and key slots alike: it comes only with q_len == kv_len.
    sequence = rows + (0 if segment is None else segment)
    q_batch, q_pos = q_real.nonzero(as_tuple=True)
    k_batch, k_pos = k_real.nonzero(as_tuple=True)
    ids_q = sequence.expand(batch, q_len)[q_batch, q_pos]
    ids_k = sequence.expand(batch, kv_len)[k_batch, k_pos]
    ids = torch.unique(torch.cat([ids_q, ids_k]))
    which_q, which_k = torch.searchsorted(ids, ids_q), torch.searchsorted(ids, ids_k)
    count_q = torch.bincount(which_q, minlength=ids.numel())
    count_k = torch.bincount(which_k, minlength=ids.numel())
    zero = count_q.new_zeros(1)
    cu_q, cu_k = torch.cat([zero, count_q.cumsum(0)]), torch.cat([zero, count_k.cumsum(0)])
    rank_q = torch.arange(q_batch.numel(), device=visible.device) - cu_q[which_q]
    diagonal = rank_q + (count_k - count_q)[which_q]  # bottom-right alignment
    # Query t of sequence s should see the real keys of s ranked lo..hi. Between two keys of s
    # in a row lie only keys of s or padding, so that set is the real keys between two slots,
    # and a row shows it if its visible keys start and end at those slots and are as many as
    # the real keys between them (its visible keys are real keys by construction).
    last_rank = count_k[which_q] - 1
    hi = diagonal.clamp(max=last_rank) if causal else last_rank
    lo = torch.zeros_like(diagonal)
    if window is not None:
        lo = (diagonal - (window - 1 if causal else window)).clamp(min=0)
        if not causal:
            hi = (diagonal + window).clamp(max=last_rank)
    whole = ids.numel() == batch and count_q.eq(q_len).all() and count_k.eq(kv_len).all()
    plan = _Plan(q_batch, q_pos, k_batch, k_pos, cu_q.int(), cu_k.int(), which_q, bool(whole))
    if q_batch.numel() == 0:
        return plan
    if bool((hi < lo).any()):
        return None
    first_key = cu_k[which_q]
    rows = visible[q_batch, q_pos].to(torch.uint8)
    first = rows.argmax(-1)
    last = kv_len - 1 - rows.flip(-1).argmax(-1)
    real_before = k_real.cumsum(-1)  # [B, Skv]: real keys up to each slot
    between = real_before[q_batch, last] - real_before[q_batch, first] + 1
    fits = (
        torch.equal(first, k_pos[first_key + lo])
        and torch.equal(last, k_pos[first_key + hi])
        and torch.equal(rows.sum(-1), hi - lo + 1)
        and torch.equal(between, hi - lo + 1)
    )
    return plan if fits else None
