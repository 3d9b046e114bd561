"""Public functions over the ``torch.ops.opmesh`` operators. They only normalise arguments; the
computation, its validation and its shape function live in the extension."""

from __future__ import annotations

import array
import operator
from collections.abc import Sequence

import torch

from . import _C
from . import platform as _platform
from ._schema import (
    ATTN_LENGTHS,
    UNBOUNDED,
    check_scalar_types,
    positional,
    schema_names,
    tensor_parameters,
    without_defaults,
)
from .distributed import DFunction
from .distributed.dispatcher import DISPATCHER
from .distributed.ops.dsa import TABLES as _DSA_TABLES
from .platform import mindspore_ops as _ms

LengthsLike = torch.Tensor | Sequence[int] | None


def _int_list(value, name: str) -> list[int]:
    """The entries of a list of lengths, each an integer (a float such as 1.5 is refused, never
    truncated)."""
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, torch.SymInt)):
            try:
                item = operator.index(item)
            except TypeError:
                raise TypeError(
                    f"{name}: entry {i} is {item!r} ({type(item).__name__}); lengths must be "
                    "integers"
                ) from None
        out.append(item)
    return out


def _on_mindspore(*values) -> bool:
    """Whether a call's tensors are MindSpore tensors (platform/mindspore_ops.py runs it then)."""
    return not torch.compiler.is_compiling() and _platform.on_mindspore(*values)


def _pick(call: dict, names) -> tuple:
    """The values of ``names`` in ``call``. (The public functions take their arguments with
    ``locals()``; a comprehension in their body would turn a local into a closure cell, which
    torch.compile cannot read there.)"""
    return tuple(call[n] for n in names)


# Every operator's overload, looked up once.
_OVERLOADS = {name: getattr(torch.ops.opmesh, name).default for name in schema_names()}


def _run(name: str, call: dict, **dispatch_only):
    """The one route of a call on PyTorch tensors: ``call`` holds the operator's arguments by
    schema name. With a DTensor among them, the dispatcher runs the operator's DistributedOp
    (docs/distributed.md), which also gets ``dispatch_only``; otherwise the operator runs
    directly. (MindSpore tensors take platform/mindspore_ops.py before this.)"""
    op = _OVERLOADS[name]  # the overload: no overload resolution or attribute lookup per call
    dtensor = _platform.current().DTensor
    kwargs = dict(call)
    args = [kwargs.pop(n) for n in positional(name)]
    # Only a tensor parameter can hold a DTensor; None and a plain tensor's exact type say it is
    # not one without asking isinstance (about 0.1 us a parameter: 2 us on flash_attn's 11).
    for v in map(call.get, tensor_parameters(name)):
        if v is not None and type(v) is not torch.Tensor and isinstance(v, dtensor):
            return DISPATCHER.dispatch(name, op, tuple(args), {**kwargs, **dispatch_only})
    if torch.compiler.is_compiling():
        # Traced once: no parsing time to save, and comparing a symbolic size with a default
        # would add a guard (and make Dynamo restart its analysis).
        return op(*args, **kwargs)
    return op(*args, **without_defaults(name, kwargs))


def _as_lengths(value: LengthsLike, name: str) -> torch.Tensor | None:
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return torch.tensor(_int_list(value, name), dtype=torch.int64)
    raise TypeError(
        f"{name}: expected a 1-D int32/int64 tensor, a list of ints or None, "
        f"got {type(value).__name__}"
    )


def dense_lightning_indexer_softmax_lse(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_qlen: LengthsLike = None,
    actual_seq_klen: LengthsLike = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
    cmp_ratio: int = 1,
    cmp_residual_key: LengthsLike = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Softmax statistics of the lightning-indexer score, without materialising the scores.

    For key head ``g``, query row ``i`` and key ``j``::

        I[g, i, j] = sum_{h in group g} weights[i, h]
                     * relu(query_index[i, h, :] . key_index[j, g, :])
        softmax_max[g, i] = max_{j visible} I[g, i, j]
        softmax_sum[g, i] = sum_{j visible} exp(I[g, i, j] - softmax_max[g, i])

    Query head ``h`` belongs to key head ``h // (N1 // N2)``. No scale is applied: fold
    ``1/sqrt(D)`` and ``1/sqrt(N1)`` into ``weights``. A row with no visible key, and a BSND row
    past its sequence's length, gets ``(-inf, 0)``.

    Args:
        query_index: ``[B, S1, N1, D]`` (BSND) or ``[T1, N1, D]`` (TND); float32, bfloat16,
            float16 or float64 (read as float32).
        key_index: ``[B, S2, N2, D]`` or ``[T2, N2, D]``, same dtype; ``N1 % N2 == 0``.
        weights: ``[B, S1, N1]`` or ``[T1, N1]``; the dtype of ``query_index`` or float32.
        actual_seq_qlen: BSND: optional per-sequence query lengths ``[B]`` (each ``<= S1``).
            TND: required cumulative ends ``[B]`` (no leading 0, non-decreasing, last ``== T1``).
        actual_seq_klen: the same for keys.
        layout: ``"BSND"`` or ``"TND"``.
        sparse_mode: 0 = every key visible; 3 = causal aligned to the bottom-right corner of each
            sequence: key ``j`` is visible to query ``i`` iff ``j <= i + s2 - s1``.
        pre_tokens, next_tokens: a band around that diagonal ``d = i + s2 - s1``: key ``j`` is
            visible only if ``d - pre_tokens <= j <= d + next_tokens`` (both ``>= 0``; the
            defaults are unbounded; with ``sparse_mode=3`` keys right of ``d`` stay hidden).
        cmp_ratio, cmp_residual_key: compressed keys (DeepSeek-V4), as for
            :func:`lightning_indexer`: key entry ``j`` stands for original tokens
            ``[j * cmp_ratio, (j + 1) * cmp_ratio)``, and with ``sparse_mode=3`` query ``i`` sees
            the entries whose last original token is at or before its position
            ``i + s2 * cmp_ratio + cmp_residual_key[b] - s1``. Not with a band; one device.

    Returns:
        ``(softmax_max, softmax_sum)``, float32, ``[B, N2, S1]`` (BSND) or ``[N2, T1]`` (TND).

    With DTensor inputs the op runs on each rank's shard under the layout rules of
    docs/distributed.md (batch and query-sequence sharding, context parallel) and returns
    DTensors.

    Work is tiled (query tiles x 64-key tiles) with the relu and weighted head sum fused and an
    online max/sum, so extra memory is O(tile) whatever the sequence lengths; fully masked tiles
    are skipped.

    MindSpore tensors in, MindSpore tensors out (docs/mindspore.md).
    """
    call = dict(locals())
    check_scalar_types("dense_lightning_indexer_softmax_lse", call)
    if _on_mindspore(query_index, key_index, weights):
        return _ms.indexer(query_index, key_index, weights, _mask(call))
    return _run("dense_lightning_indexer_softmax_lse", _torch_lengths(call))


_LENGTH_NAMES = ("actual_seq_qlen", "actual_seq_klen", "cmp_residual_key")
# The indexer family's mask, length and compressed-key arguments, which its functions share.
_MASK_NAMES = (*_LENGTH_NAMES[:2], "layout", "sparse_mode", "pre_tokens", "next_tokens",
               "cmp_ratio", "cmp_residual_key")  # fmt: skip
# The dense front's parameters, in the order its DFunction takes them (the layout rules' table).
_KL_PARAMETERS = _DSA_TABLES["indexer_kl_loss"].params


def _mask(call: dict) -> dict:
    return {n: call[n] for n in _MASK_NAMES}


def _torch_lengths(call: dict) -> dict:
    """A call's arguments with the length lists as torch tensors."""
    return {k: _as_lengths(v, k) if k in _LENGTH_NAMES else v for k, v in call.items()}


def dense_lightning_indexer_grad_kl_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    softmax_max_index: torch.Tensor,
    softmax_sum_index: torch.Tensor,
    scale_value: float = 1.0,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_qlen: LengthsLike = None,
    actual_seq_klen: LengthsLike = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
    cmp_ratio: int = 1,
    cmp_residual_key: LengthsLike = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The KL loss that trains the lightning indexer against the main attention, and its
    gradients with respect to the indexer's inputs, fused (no S1 x S2 matrix is formed).

    For each query token ``t`` and the keys ``j`` it sees::

        p[h, t, j] = exp(scale_value * (q[t, h] . k[j, h // G]) - softmax_max[h, t])
                     / softmax_sum[h, t]          (q, k with their rope parts concatenated)
        P[t, j]    = sum_h p[h, t, j], normalised to sum 1 over j (the target)
        I[g, t, j] = sum_{h in g} weights[t, h] * relu(query_index[t, h] . key_index[j, g])
        loss       = sum_t sum_g KL(P[t] || softmax_j(I[g, t]))

    where ``softmax_j(I[g, t])`` uses the given ``softmax_max_index`` / ``softmax_sum_index``.

    Args:
        query, key: the main attention's ``[B, S1, N1, D]`` / ``[B, S2, N2, D]`` (BSND) or
            ``[T1, N1, D]`` / ``[T2, N2, D]`` (TND); ``N1 % N2 == 0``.
        query_index, key_index, weights: the indexer's inputs, as for
            :func:`dense_lightning_indexer_softmax_lse`.
        softmax_max, softmax_sum: the main attention's statistics, float32 ``[B, N2, S1, G]`` /
            ``[N2, T1, G]`` with ``G = N1 // N2``. flash_attn's log-sum-exp as the max with a
            sum of ones is equivalent.
        softmax_max_index, softmax_sum_index: the indexer's, from
            :func:`dense_lightning_indexer_softmax_lse` with the same arguments.
        scale_value: the main attention's softmax scale.
        query_rope, key_rope: optional ``[.., N1, Dr]`` and ``[.., N2, Dr]`` parts concatenated
            to ``query`` and ``key`` along the head dim (MLA).
        actual_seq_qlen, actual_seq_klen, layout, sparse_mode, pre_tokens, next_tokens: as for
            :func:`dense_lightning_indexer_softmax_lse`.

    Returns:
        ``(d_query_index, d_key_index, d_weights, loss)``: the gradients in the dtypes and
        shapes of their inputs, and the loss as float32 ``[1]``. The loss is differentiable in
        ``query_index``, ``key_index`` and ``weights`` (its backward scales these gradients);
        the main attention and the statistics are a fixed target and may not require a
        gradient.
    """
    call = dict(locals())
    check_scalar_types("dense_lightning_indexer_grad_kl_loss", call)
    if _on_mindspore(query, key, query_index, key_index, weights):
        args = _pick(call, positional("dense_lightning_indexer_grad_kl_loss"))
        return _ms.grad_kl_loss(args, query_rope, key_rope, _mask(call))
    return _run("dense_lightning_indexer_grad_kl_loss", _torch_lengths(call))


def indexer_kl_loss(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    scale_value: float = 1.0,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_qlen: LengthsLike = None,
    actual_seq_klen: LengthsLike = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
    cmp_ratio: int = 1,
    cmp_residual_key: LengthsLike = None,
) -> torch.Tensor:
    """The indexer's training loss as one differentiable call: computes the indexer's softmax
    statistics, then :func:`dense_lightning_indexer_grad_kl_loss`, and returns the loss (float32
    ``[1]``), whose backward delivers the fused gradients to ``query_index``, ``key_index`` and
    ``weights``. The main attention (``query``, ``key``, the rope parts and its statistics) is
    the fixed target: pass it detached.

    A ``DFunction``: with plain tensors it is ordinary autograd, eagerly and under
    ``torch.compile``, and MindSpore's autograd on MindSpore tensors."""
    call = dict(locals())
    check_scalar_types("dense_lightning_indexer_grad_kl_loss", call)
    on_mindspore = _on_mindspore(query_index, key_index, weights)
    if not on_mindspore:
        call = _torch_lengths(call)
    if torch.is_grad_enabled() and not on_mindspore:
        _refuse_gradients_of_the_target(call)
    return _KlLossFunction.apply(*_pick(call, _KL_PARAMETERS))


def _refuse_gradients_of_the_target(call: dict) -> None:
    """The KL losses treat the main attention (query, key, the ropes, its statistics) as a fixed
    target: one that requires a gradient is refused rather than given none."""
    for name in ("query", "key", "query_rope", "key_rope", "softmax_max", "softmax_sum"):
        t = call[name]
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"{name}: requires a gradient, but the KL loss treats the main attention as "
                f"a fixed target and has no gradient for it; pass {name}.detach()"
            )


class _KlLossFunction(DFunction):
    """The indexer's KL loss: forward on local tensors runs the two operators; backward scales
    the gradients the fused operator returned. Its parameters are indexer_kl_loss's, in the
    order of ``TABLES["indexer_kl_loss"].params`` (opmesh/distributed/ops/dsa.py)."""

    _op_name = "indexer_kl_loss"

    @staticmethod
    def forward(ctx, *values):
        call = dict(zip(_KL_PARAMETERS, values, strict=True))
        q_side = {n: call[n] for n in ("query_index", "key_index", "weights")}
        # The operators of the tensors' framework (the forward is written once for both).
        if _on_mindspore(call["query_index"]):
            max_index, sum_index = _ms.indexer(*q_side.values(), _mask(call))
            call.update(softmax_max_index=max_index, softmax_sum_index=sum_index)
            args = tuple(call[n] for n in positional("dense_lightning_indexer_grad_kl_loss"))
            d_query_index, d_key_index, d_weights, loss = _ms.grad_kl_loss(
                args, call["query_rope"], call["key_rope"], _mask(call), differentiable=False
            )
        else:
            max_index, sum_index = torch.ops.opmesh.dense_lightning_indexer_softmax_lse(
                *q_side.values(), **_mask(call)
            )
            call.update(softmax_max_index=max_index, softmax_sum_index=sum_index)
            names = positional("dense_lightning_indexer_grad_kl_loss")
            args = [call.pop(n) for n in names]
            d_query_index, d_key_index, d_weights, loss = (
                torch.ops.opmesh.dense_lightning_indexer_grad_kl_loss(*args, **call)
            )
        ctx.save_for_backward(d_query_index, d_key_index, d_weights)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The main attention and the rest are a fixed target (no gradient).
        rest = len(_KL_PARAMETERS) - 3
        return _platform.scaled_gradients(ctx.saved_tensors, grad_loss) + (None,) * rest


def sparse_lightning_indexer_grad_kl_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_qlen: LengthsLike = None,
    actual_seq_klen: LengthsLike = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
    cmp_ratio: int = 1,
    cmp_residual_key: LengthsLike = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The indexer's KL loss over the keys ``sparse_indices`` select (DeepSeek sparse
    attention's sparse stage), and its gradients with respect to the indexer's inputs, fused.

    For token ``t`` and index key head ``g``, ``S`` is the set of keys the row of
    ``sparse_indices`` lists (positions within the sequence; ``-1`` skipped) that the token
    sees under the mask::

        P[t, j]    = sum_h exp(scale_value * (q[t, h] . k[j, h // G]) - lse[h, t]),  j in S
                     normalised to sum 1 over S (the target; q, k with their rope parts)
        I[g, t, j] = sum_{h in g} weights[t, h] * relu(query_index[t, h] . key_index[j, g])
        loss       = sum_t sum_g KL(P[t] || softmax over S of I[g, t])

    with ``lse = softmax_max + log(softmax_sum)``; a row whose target has no mass (nothing
    selected) contributes nothing. The gradients are those of the dense loss summed over ``S``.

    Args:
        query, key: the main attention's, as for :func:`dense_lightning_indexer_grad_kl_loss`.
        query_index, key_index, weights: the indexer's inputs, as for
            :func:`lightning_indexer` (``N1index % N2index == 0``).
        sparse_indices: int32/int64 ``[B, S1, N2index, K]`` / ``[T1, N2index, K]`` key positions
            (``lightning_indexer``'s output); a key-head dim of 1 applies one selection to every
            index key head. An entry below -1, past the sequence, or repeated in a row raises
            ``ValueError`` naming the row.
        softmax_max, softmax_sum: the main attention's statistics over the same selection,
            float32 ``[B, N2, S1, G]`` / ``[N2, T1, G]`` (:func:`sparse_flash_attention` with
            ``return_softmax_lse=True``). Only their log-sum-exp matters: the target is
            renormalised over ``S``.
        scale_value: the main attention's softmax scale.
        query_rope, key_rope, actual_seq_qlen, actual_seq_klen, layout, sparse_mode,
            pre_tokens, next_tokens: as for :func:`dense_lightning_indexer_grad_kl_loss`.

    Returns:
        ``(d_query_index, d_key_index, d_weights, loss)`` as the dense operator returns them;
        the loss is differentiable in ``query_index``, ``key_index`` and ``weights``, the main
        attention and its statistics may not require a gradient. Deterministic: the same bits
        for any thread count.
    """
    call = dict(locals())
    check_scalar_types(_SPARSE_KL_OP, call)
    if _on_mindspore(query, key, query_index, key_index, weights):
        return _ms.sparse_grad_kl_loss(call)
    return _run("sparse_lightning_indexer_grad_kl_loss", _torch_lengths(call))


# The sparse front's parameters, in the order its DFunction takes them.
_SPARSE_KL_PARAMETERS = _DSA_TABLES["sparse_indexer_kl_loss"].params
_SPARSE_KL_OP = "sparse_lightning_indexer_grad_kl_loss"


def sparse_indexer_kl_loss(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_qlen: LengthsLike = None,
    actual_seq_klen: LengthsLike = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
    cmp_ratio: int = 1,
    cmp_residual_key: LengthsLike = None,
) -> torch.Tensor:
    """The indexer's sparse-stage training loss as one differentiable call: runs
    :func:`sparse_lightning_indexer_grad_kl_loss` and returns the loss (float32 ``[1]``), whose
    backward delivers the fused gradients to ``query_index``, ``key_index`` and ``weights``.
    The main attention (``query``, ``key``, the rope parts and its statistics) and the
    selection are the fixed target: pass them detached.

    A ``DFunction``: with plain tensors it is ordinary autograd, eagerly and under
    ``torch.compile``, and MindSpore's autograd on MindSpore tensors."""
    call = dict(locals())
    check_scalar_types(_SPARSE_KL_OP, call)
    on_mindspore = _on_mindspore(query_index, key_index, weights)
    if not on_mindspore:
        call = _torch_lengths(call)
    if torch.is_grad_enabled() and not on_mindspore:
        _refuse_gradients_of_the_target(call)
    return _SparseKlLossFunction.apply(*_pick(call, _SPARSE_KL_PARAMETERS))


class _SparseKlLossFunction(DFunction):
    """The sparse KL loss: forward runs the fused operator of the tensors' framework; backward
    scales the gradients it returned. Parameters in the order of ``_SPARSE_KL_PARAMETERS``."""

    _op_name = "sparse_indexer_kl_loss"

    @staticmethod
    def forward(ctx, *values):
        call = dict(zip(_SPARSE_KL_PARAMETERS, values, strict=True))
        if _on_mindspore(call["query_index"]):
            outputs = _ms.sparse_grad_kl_loss(call, differentiable=False)
        else:
            args = [call.pop(n) for n in positional(_SPARSE_KL_OP)]
            outputs = torch.ops.opmesh.sparse_lightning_indexer_grad_kl_loss(*args, **call)
        d_query_index, d_key_index, d_weights, loss = outputs
        ctx.save_for_backward(d_query_index, d_key_index, d_weights)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        rest = len(_SPARSE_KL_PARAMETERS) - 3
        return _platform.scaled_gradients(ctx.saved_tensors, grad_loss) + (None,) * rest


def lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: LengthsLike = None,
    actual_seq_lengths_key: LengthsLike = None,
    block_table: torch.Tensor | Sequence[Sequence[int]] | None = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
    return_value: bool = False,
    scale_value: float = 1.0,
    cmp_ratio: int = 1,
    cmp_residual_key: LengthsLike = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The ``sparse_count`` keys with the highest lightning-indexer score, per token and key head.

    For token ``t``, key head ``g`` and key ``s`` of ``t``'s sequence::

        I[t, g, s] = sum_{h in group g} weights[t, h] * relu(query[t, h, :] . key[s, g, :])

    ``sparse_indices[t, g]`` lists the positions ``s`` (within the sequence) of the
    ``sparse_count`` highest ``I[t, g, s]`` among the keys ``t`` sees, in descending score, ties
    to the lower position, padded with ``-1`` when fewer are visible. (A NaN score ranks above
    every number; ``-0.0`` equals ``0.0``.) Query head ``h`` belongs to key head
    ``h // (N1 // N2)``. No scale enters the selection (``scale_value`` scales the returned scores).

    Args:
        query: ``[B, S1, N1, D]`` (``layout_query="BSND"``) or ``[T1, N1, D]`` (``"TND"``);
            float32, bfloat16, float16 or float64 (read as float32). Any N1, any D.
        key: the layout of ``query`` with ``N2`` heads (``N1 % N2 == 0``), or
            ``layout_key="PA_BSND"``: a paged cache ``[block_count, block_size, N2, D]`` read
            through ``block_table``. Same dtype as ``query``.
        weights: ``[B, S1, N1]`` or ``[T1, N1]``; the dtype of ``query`` or float32.
        actual_seq_lengths_query: BSND: optional per-sequence query lengths ``[B]``; TND:
            required cumulative ends ``[B]`` (no leading 0, non-decreasing, last ``== T1``).
        actual_seq_lengths_key: BSND: optional per-sequence key lengths; TND: required
            cumulative ends; PA_BSND: required per-sequence lengths (one per query sequence).
        block_table: PA_BSND only: ``[B, max_blocks]`` int32/int64, the cache blocks of each
            sequence in order.
        layout_query: ``"BSND"`` or ``"TND"``.
        layout_key: ``layout_query``'s value, or ``"PA_BSND"``.
        sparse_count: K, from 1 to 65536; K may exceed the visible keys (the rest is ``-1``).
        sparse_mode: 0 = every key visible; 3 = causal aligned to the bottom-right corner of each
            sequence: key ``s`` is visible to query ``i`` iff ``s <= i + s2 - s1``.
        pre_tokens, next_tokens: a band around that diagonal ``d``: key ``s`` is visible only if
            ``d - pre_tokens <= s <= d + next_tokens`` (unbounded by default).
        return_value: also return the selected scores.
        scale_value: the factor of the returned scores (``sparse_values = scale_value * I``;
            finite and ``> 0``), such as the model's ``softmax_scale``: the selection ranks ``I``
            itself, so it is the same for any scale.
        cmp_ratio: compressed keys (DeepSeek-V4): key entry ``s`` stands for the original key
            tokens ``[s * cmp_ratio, (s + 1) * cmp_ratio)``. With ``sparse_mode=3`` query ``i``
            of a sequence of ``s1`` queries and ``s2`` entries sees entry ``s`` iff
            ``(s + 1) * cmp_ratio <= i + s2 * cmp_ratio + r - s1 + 1``: its last original token
            is at or before the query's (bottom-right aligned) diagonal, ``r`` being the
            sequence's residual below. 1 (the default) is the uncompressed mask; no band
            (``pre_tokens`` / ``next_tokens``) with ``cmp_ratio > 1``.
        cmp_residual_key: with ``cmp_ratio > 1``, per sequence ``[B]``: the original key tokens
            past the last whole entry (the original count modulo ``cmp_ratio``), each in
            ``[0, cmp_ratio)``; ``None`` for all 0.

    Returns:
        ``(sparse_indices, sparse_values)``: int32 ``[B, S1, N2, K]`` (BSND) or ``[T1, N2, K]``
        (TND), and the float32 scores alongside (``-inf`` where the index is ``-1``) when
        ``return_value``, else an empty tensor. BSND rows past a sequence's length are all
        ``-1``. The outputs are not differentiable (no gradient flows through a selection).

    Streaming over 64-key tiles with the relu and weighted head sum fused: no ``S1 x S2`` score
    matrix; extra memory is O(tile + rows x K). The result is the same bits for any thread
    count.

    MindSpore tensors in, MindSpore tensors out (docs/mindspore.md).
    """
    call = dict(locals())
    check_scalar_types("lightning_indexer", call)
    if _on_mindspore(query, key, weights):
        return _ms.lightning_indexer(call)
    call["actual_seq_lengths_query"] = _as_lengths(
        actual_seq_lengths_query, "actual_seq_lengths_query"
    )
    call["actual_seq_lengths_key"] = _as_lengths(actual_seq_lengths_key, "actual_seq_lengths_key")
    call["block_table"] = _as_table(block_table)
    call["cmp_residual_key"] = _as_lengths(cmp_residual_key, "cmp_residual_key")
    return _run("lightning_indexer", call)


def sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    block_table: torch.Tensor | Sequence[Sequence[int]] | None = None,
    actual_seq_lengths_query: LengthsLike = None,
    actual_seq_lengths_kv: LengthsLike = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    sparse_block_size: int = 1,
    layout_query: str = "BSND",
    layout_kv: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
    attention_mode: int = 0,
    softcap: float | None = None,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Attention of each query token over the keys its ``sparse_indices`` select.

    For token ``t`` and query head ``h`` of key head ``g = h // (N1 // N2)``, the selected keys
    ``S`` are the blocks ``[i * sparse_block_size, (i + 1) * sparse_block_size)`` of the row's
    indices ``i >= 0`` (``-1`` is skipped), intersected with the keys the token sees::

        s[j] = scale_value * (query[t, h] . key[j, g] + query_rope[t, h] . key_rope[j, g])
        s[j] = softcap * tanh(s[j] / softcap)   (softcap > 0 only)
        out[t, h] = sum_{j in S} exp(s[j] - m) value[j, g] / (l + exp(sinks[h] - m))
        m = max_{j in S} s[j],  l = sum_{j in S} exp(s[j] - m)

    (no sink term without ``sinks``). A row that selects nothing gives zeros.

    Args:
        query: ``[B, S1, N1, D]`` (``layout_query="BSND"``) or ``[T1, N1, D]`` (``"TND"``);
            float32, bfloat16, float16 or float64.
        key, value: ``layout_query``'s layout with ``N2`` heads (``N1 % N2 == 0``), or
            ``layout_kv="PA_BSND"``: paged ``[block_count, block_size, N2, D]`` read through
            ``block_table``. ``value`` may have its own head dim ``Dv``; with
            ``attention_mode=2`` (MLA absorb) it is the same tensor as ``key``.
        sparse_indices: int32/int64 ``[B, S1, N2, K]`` / ``[T1, N2, K]``, block indices within
            the row's sequence; a key-head dim of 1 applies one selection to every key head. An
            entry below -1, past the sequence's blocks, or repeated in a row raises
            ``ValueError`` naming the row.
        scale_value: the score scale.
        block_table, actual_seq_lengths_query, actual_seq_lengths_kv: as for
            :func:`lightning_indexer` (``actual_seq_lengths_kv`` for keys and values).
        query_rope, key_rope: optional ``[.., N1, Dr]`` / ``[.., N2, Dr]`` in query's and key's
            layouts, added to the score's dot product; both or neither.
        sparse_mode, pre_tokens, next_tokens: the mask, as for :func:`lightning_indexer`.
        softcap: logit soft-capping (as Gemma 2 and :func:`flash_attn`): a finite value
            ``>= 0``; None or 0 leaves the scores as they are.
        return_softmax_lse: also return the statistics.
        sinks: optional ``[N1]`` per-head sink logits (a key with no value in every row).
        key_scale, value_scale: float32 row scales of a quantized key and value (int8 or
            ``float8_e4m3fn``, as :func:`kv_cache_write_` writes them), shaped as key and value
            without their head dim; row ``j`` reads as ``key[j] * key_scale[j]`` (rounded to bf16
            for bf16 queries), ``key_rope`` stays in query's dtype. Forward only.

    Returns:
        ``(attention_out, softmax_max, softmax_sum)``: attention_out in query's layout with
        ``Dv``; with ``return_softmax_lse`` float32 ``m`` and ``l`` above, ``[B, N2, S1, G]`` /
        ``[N2, T1, G]`` (``G = N1 // N2``; ``(-inf, 0)`` where nothing is selected), the form
        the indexer KL losses take; otherwise empty tensors.

    Differentiable in query, key, value, the ropes and sinks (not with paged keys); the
    statistics are not. Deterministic: the same bits for any thread count, backward included.
    """
    call = dict(locals())
    check_scalar_types("sparse_flash_attention", call)
    if softcap is None or softcap == 0.0:
        del call["softcap"]  # the schema's default (see flash_attn)
    if _on_mindspore(query, key, value):
        return _ms.sparse_flash_attention(call)
    call["actual_seq_lengths_query"] = _as_lengths(
        actual_seq_lengths_query, "actual_seq_lengths_query"
    )
    call["actual_seq_lengths_kv"] = _as_lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv")
    call["block_table"] = _as_table(block_table)
    return _run("sparse_flash_attention", call)


def _as_table(value, name: str = "block_table") -> torch.Tensor | None:
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return torch.tensor([_int_list(row, name) for row in value], dtype=torch.int64)
    raise TypeError(
        f"{name}: expected a 2-D int32/int64 tensor, a list of lists of ints or None, "
        f"got {type(value).__name__}"
    )


# sparse_flash_mla's per-sequence arrays (lists become tensors) and block tables.
_MLA_LENGTHS = (
    "cu_seqlens_q",
    "cu_seqlens_ori_kv",
    "cu_seqlens_cmp_kv",
    "seqused_q",
    "seqused_ori_kv",
    "seqused_cmp_kv",
    "cmp_residual_kv",
)
_MLA_TABLES = ("ori_block_table", "cmp_block_table")


def sparse_flash_mla_metadata(
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    *,
    cu_seqlens_q: LengthsLike = None,
    cu_seqlens_ori_kv: LengthsLike = None,
    cu_seqlens_cmp_kv: LengthsLike = None,
    seqused_q: LengthsLike = None,
    seqused_ori_kv: LengthsLike = None,
    seqused_cmp_kv: LengthsLike = None,
    cmp_residual_kv: LengthsLike = None,
    ori_topk_length: torch.Tensor | None = None,
    cmp_topk_length: torch.Tensor | None = None,
    batch_size: int = 0,
    max_seqlen_q: int = 0,
    max_seqlen_ori_kv: int = 0,
    max_seqlen_cmp_kv: int = 0,
    ori_topk: int = 0,
    cmp_topk: int = 0,
    cmp_ratio: int = 1,
    ori_mask_mode: int = 0,
    cmp_mask_mode: int = 0,
    ori_win_left: int = -1,
    ori_win_right: int = -1,
    layout_q: str = "BSND",
    layout_kv: str = "BSND",
    has_ori_kv: bool = True,
    has_cmp_kv: bool = True,
    num_workers: int | None = None,
) -> torch.Tensor:
    r"""Plans a :func:`sparse_flash_mla` call: returns the int32 CPU metadata tensor that cuts
    the batch's work into one contiguous stretch per logical worker, and records every argument
    and length array the call must match (a mismatched call raises ``ValueError`` naming
    ``metadata``). The work is a sequence of units, one per query row and key head, each
    predicted to cost the keys it reads in both key tensors plus a fixed overhead; a stretch may
    end inside a unit, whose pieces then merge by their log-sum-exp.

    The arguments are the call's, described without tensors: ``batch_size`` (BSND; TND takes
    it from ``cu_seqlens_q``), ``max_seqlen_*`` (BSND: the tensors' sequence dims; TND and paged
    keys: the longest length), ``ori_topk`` / ``cmp_topk`` (the selections' ``K``, 0 without
    one), ``has_ori_kv`` / ``has_cmp_kv``. The mask defaults (0, 0) are Ascend's, not
    :func:`sparse_flash_mla`'s (4, 3): pass them explicitly. ``num_workers`` defaults to
    ``torch.get_num_threads()``; the tensor holds ``53 + 5 * num_workers`` words.
    :func:`describe_metadata` summarises it.
    """
    call = dict(locals())
    check_scalar_types("sparse_flash_mla_metadata", call)
    # MindSpore arrays are planned on the host like any other; the plan comes back as theirs.
    on_mindspore = _on_mindspore(*call.values())
    for name in (*_MLA_LENGTHS, "ori_topk_length", "cmp_topk_length"):
        if on_mindspore and _platform.on_mindspore(call[name]):
            call[name] = torch.from_numpy(call[name].asnumpy())
    for name in _MLA_LENGTHS:
        call[name] = _as_lengths(call[name], name)
    plan = _OVERLOADS["sparse_flash_mla_metadata"](
        num_heads_q,
        num_heads_kv,
        head_dim,
        **{n: v for n, v in call.items() if n not in ("num_heads_q", "num_heads_kv", "head_dim")},
    )
    return _ms.from_torch(plan) if on_mindspore else plan


def sparse_flash_mla(
    q: torch.Tensor,
    *,
    ori_kv: torch.Tensor | None = None,
    cmp_kv: torch.Tensor | None = None,
    ori_sparse_indices: torch.Tensor | None = None,
    cmp_sparse_indices: torch.Tensor | None = None,
    ori_block_table: torch.Tensor | Sequence[Sequence[int]] | None = None,
    cmp_block_table: torch.Tensor | Sequence[Sequence[int]] | None = None,
    cu_seqlens_q: LengthsLike = None,
    cu_seqlens_ori_kv: LengthsLike = None,
    cu_seqlens_cmp_kv: LengthsLike = None,
    seqused_q: LengthsLike = None,
    seqused_ori_kv: LengthsLike = None,
    seqused_cmp_kv: LengthsLike = None,
    cmp_residual_kv: LengthsLike = None,
    ori_topk_length: torch.Tensor | None = None,
    cmp_topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    metadata: torch.Tensor | None = None,
    softmax_scale: float = 1.0,
    cmp_ratio: int = 1,
    ori_mask_mode: int = 4,
    cmp_mask_mode: int = 3,
    ori_win_left: int = -1,
    ori_win_right: int = -1,
    layout_q: str = "BSND",
    layout_kv: str = "BSND",
    topk_value_mode: int = 1,
    return_softmax_lse: bool = False,
    ori_kv_scale: torch.Tensor | None = None,
    cmp_kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""DeepSeek-V4's attention: shared key/value over a window of original keys and over
    compressed keys, one softmax over both and the sink.

    For token ``t`` (position ``i`` in its sequence) and query head ``h`` of key head
    ``g = h // (N1 // N2)``, the keys are ``ori_kv``'s the ``ori_*`` mask lets the row see (all
    of them, or those ``ori_sparse_indices`` names) followed by ``cmp_kv``'s (all the row may see,
    or those ``cmp_sparse_indices`` names)::

        s[j] = softmax_scale * q[t, h] . kv[j, g]
        out[t, h] = sum_j exp(s[j] - lse) kv[j, g]
        lse = log(sum_j exp(s[j]) + exp(sinks[h]))

    ``ori_mask_mode`` 0 shows every key, 3 is causal aligned to the bottom-right corner of each
    sequence, 4 the window ``[diag - ori_win_left, diag + ori_win_right]`` (``-1``: unbounded).
    ``cmp_mask_mode`` 3 lets a row see compressed entry ``j`` when its last original token,
    ``(j + 1) * cmp_ratio - 1``, is at or before the row's position counted in original tokens
    (``cmp_len * cmp_ratio + cmp_residual_kv[b]`` of them, bottom-right aligned); 0 shows all.
    Selected entries (``-1`` skipped, only the first ``*_topk_length`` of a row when given) are
    kept within the mask. A row with no key and no sink gives zeros.

    Args:
        q: ``[B, S1, N1, D]`` (``layout_q="BSND"``) or ``[T1, N1, D]`` (``"TND"``); float32,
            bfloat16, float16 or float64.
        ori_kv, cmp_kv: q's layout with ``N2`` heads dividing ``N1`` and head dim ``D``, or
            ``layout_kv="PA_BBND"``: paged ``[blocks, block_size, N2, D]`` read through
            ``ori_block_table`` / ``cmp_block_table`` ``[B, max_blocks]``. At least one.
        ori_sparse_indices, cmp_sparse_indices: int32/int64 ``[B, S1, N2, K]`` / ``[T1, N2, K]``
            token indices within the row's sequence; a repeated or out-of-range entry raises
            ``ValueError`` naming the row.
        cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv: TND ``[B + 1]`` cumulative token
            counts from 0.
        seqused_q, seqused_ori_kv, seqused_cmp_kv: ``[B]`` lengths used (required for paged
            keys).
        cmp_residual_kv: ``[B]`` original tokens past each sequence's last whole compressed
            entry, in ``[0, cmp_ratio)`` (with ``cmp_mask_mode=3`` and ``cmp_ratio > 1``; 0 when
            absent).
        ori_topk_length, cmp_topk_length: int32/int64 ``[B, S1, N2]`` / ``[T1, N2]``.
        sinks: optional ``[N1]`` per-head sink logits.
        metadata: the plan of :func:`sparse_flash_mla_metadata`, checked against the call.
        topk_value_mode: 1 (indices are token positions), the only mode.
        return_softmax_lse: also return ``lse`` above.
        ori_kv_scale, cmp_kv_scale: float32 row scales of a quantized ori_kv / cmp_kv (int8 or
            ``float8_e4m3fn``, as :func:`kv_cache_write_` writes them), shaped as the kv without
            its head dim; row ``j`` reads as ``kv[j] * scale[j]`` (rounded to bf16 for bf16
            queries). Forward only.

    Returns:
        ``(attention_out, softmax_lse)``: attention_out like q; with ``return_softmax_lse``
        float32 ``[B, N2, S1, G]`` / ``[N2, T1, G]`` (``G = N1 // N2``), otherwise a float32
        scalar 0.

    Differentiable in q, ori_kv, cmp_kv and sinks (not with paged keys), through the output and
    the returned lse. Deterministic: the same bits for any thread count, backward included.
    """
    call = dict(locals())
    check_scalar_types("sparse_flash_mla", call)
    if _on_mindspore(q, ori_kv, cmp_kv):
        return _ms.sparse_flash_mla(call)
    for name in _MLA_LENGTHS:
        call[name] = _as_lengths(call[name], name)
    for name in _MLA_TABLES:
        call[name] = _as_table(call[name], name)
    return _run("sparse_flash_mla", call)


def compressor(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor,
    state_cache: torch.Tensor | None,
    ape: torch.Tensor,
    cmp_ratio: int,
    *,
    state_block_table: torch.Tensor | Sequence[int] | Sequence[Sequence[int]] | None = None,
    cu_seqlens: LengthsLike = None,
    seqused: LengthsLike = None,
    start_pos: LengthsLike = None,
    coff: int = 1,
    cache_mode: int = 1,
    projections: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""DeepSeek-V4's compressor: every ``cmp_ratio`` tokens of a sequence become one compressed
    key/value entry, a per-channel softmax-weighted sum of the tokens' projections.

    Token ``p`` (absolute position ``start_pos[b] + i``) projects to ``kv_p = wkv @ x_p`` and
    ``score_p = wgate @ x_p + ape[p % cmp_ratio]`` (``coff * D`` channels each). Entry ``w``
    (``r = cmp_ratio``) is emitted by the call holding its last token ``(w + 1) r - 1``::

        cmp_kv[w, c] = sum_j softmax_j(score_j[c]) kv_j[c]

    over the slots ``j`` of window ``w`` (positions ``[w r, (w + 1) r)``, channels ``[0, D)``)
    with ``coff=1``; with ``coff=2`` over window ``w - 1``'s positions on channels ``[0, D)``
    (when ``w >= 1``) and window ``w``'s on channels ``[D, 2 D)``: two overlapping series, each
    entry spanning ``2 r`` tokens. Positions before ``start_pos`` are read from ``state_cache``,
    which holds ``[kv_p | score_p]`` (float32, ``2 coff D``) per position; the call stores each of
    its tokens there, so decoding token by token emits an entry every ``r`` tokens.

    Args:
        x: ``[B, S, H]``, or ``[T, H]`` with ``cu_seqlens``; float32, bfloat16, float16 or
            float64 (computed in float32).
        wkv, wgate: ``[coff * D, H]``, x's dtype.
        state_cache: float32 ``[block_num, block_size, 2 * coff * D]`` updated in place, or
            None (no history: ``start_pos`` must be 0), which the operator receives as a state
            cache of no blocks.
        ape: ``[cmp_ratio, coff * D]`` position biases, any floating dtype.
        cmp_ratio: tokens per entry, any positive integer.
        state_block_table: int ``[B, blocks]`` with ``cache_mode=1`` (position ``p`` in block
            ``table[b, p // block_size]``, slot ``p % block_size``), ``[B]`` with
            ``cache_mode=2`` (a ring: slot ``p % block_size`` of block ``table[b]``, needing
            ``block_size >= coff * cmp_ratio``). Block 0 means none: its positions are not
            stored, and reading one is refused.
        cu_seqlens: ``[B + 1]`` offsets of the sequences in x ``[T, H]``.
        seqused: ``[B]`` tokens compressed per sequence (the rest of its rows are ignored).
        start_pos: ``[B]`` absolute position of each sequence's first token (0 when absent).
        coff: 1, or 2 for the overlapping series.
        cache_mode: 1 (continuous) or 2 (ring buffer).
        projections: float32 ``[B, S, 2 * coff * D]`` (``[T, 2 * coff * D]`` for x ``[T, H]``),
            written in place: each token the call uses gets its row ``[kv_p | score_p]``, the
            values ``compressor_backward(..., projections=...)`` then reads instead of computing
            them again. Autograd keeps one itself when a gradient is needed; None otherwise.

    Returns:
        cmp_kv in x's dtype: ``[B, ceil(S / r), D]`` (sequence ``b``'s entries first, zeros
        after), or ``[min(T, T // r + B), D]`` for x ``[T, H]`` (the sequences' entries one after
        another, zeros after).

    Differentiable in x, wkv, wgate and ape when no entry reads the state cache (its values are
    constants the forward found there; such a backward is refused by name). ``state_cache``'s
    version counter advances, and under ``torch.compile`` the op is functionalized and written
    back in place.
    """
    call = dict(locals())
    check_scalar_types("compressor", call)
    if _on_mindspore(x, wkv, wgate, ape):
        return _ms.compressor(call)
    if state_cache is None:
        # A plain tensor (x.new_empty of a DTensor would be a DTensor).
        call["state_cache"] = torch.empty(
            (0, 1, 2 * wkv.shape[0]), dtype=torch.float32, device=x.device
        )
    for name in ("cu_seqlens", "seqused", "start_pos"):
        call[name] = _as_lengths(call[name], name)
    table = call["state_block_table"]
    if isinstance(table, (list, tuple)) and not table and cache_mode == 1:
        call["state_block_table"] = torch.empty((0, 0), dtype=torch.int64)  # no sequences' rows
    elif isinstance(table, (list, tuple)) and table and isinstance(table[0], (list, tuple)):
        call["state_block_table"] = _as_table(table, "state_block_table")
    else:
        call["state_block_table"] = _as_lengths(table, "state_block_table")
    return _run("compressor", call)


def _as_int32(value: LengthsLike, name: str) -> torch.Tensor | None:
    if value is None:
        return value
    if isinstance(value, torch.Tensor):
        # int64 lengths (what torch.cumsum gives) are taken as int32, as the indexer takes both;
        # eagerly, values outside the int32 range are refused rather than wrapped.
        if value.dtype != torch.int64:
            return value
        if value.numel() and not torch.compiler.is_compiling() and value.device.type != "meta":
            low, high = (int(x) for x in value.aminmax())
            if low < -(2**31) or high >= 2**31:
                bad = low if low < -(2**31) else high
                raise ValueError(f"{name}: entry {bad} is outside the int32 range")
        return value.to(torch.int32)
    if isinstance(value, (list, tuple)):
        entries = _int_list(value, name)
        for i, item in enumerate(entries):
            if not isinstance(item, torch.SymInt) and not -(2**31) <= item < 2**31:
                raise ValueError(f"{name}: entry {i} is {item}, outside the int32 range")
        return torch.tensor(entries, dtype=torch.int32)
    raise TypeError(
        f"{name}: expected a 1-D int32 tensor, a list of ints or None, got {type(value).__name__}"
    )


# flash_attn's context-parallel strategies (docs/distributed.md).
_CONTEXT_PARALLEL = (
    "all_gather",
    "ring",
    "ulysses",
    ("ulysses", "ring"),
    ("ulysses", "all_gather"),
)


def flash_attn_metadata(
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    *,
    head_dim_v: int | None = None,
    cu_seqlens_q: LengthsLike = None,
    cu_seqlens_kv: LengthsLike = None,
    seqused_q: LengthsLike = None,
    seqused_kv: LengthsLike = None,
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    mask_mode: int = 0,
    win_left: int = -1,
    win_right: int = -1,
    layout_q: str = "BSND",
    layout_kv: str | None = None,
    layout_out: str | None = None,
    num_workers: int | None = None,
    deterministic: bool = False,
    backward: bool = False,
) -> torch.Tensor:
    """Plans a :func:`flash_attn` call: returns the int32 CPU metadata tensor that describes how
    its work is cut into tasks and spread over ``num_workers`` logical workers.

    Takes the non-tensor arguments of the call it plans (see :func:`flash_attn` for their
    meaning, with the same defaults: ``layout_kv`` and ``layout_out`` follow ``layout_q``; pass
    ``layout_kv="PA_BBND"`` for a paged cache) and the sequence-length arrays, whose values it
    reads. ``num_workers`` defaults to
    ``torch.get_num_threads()``. The tensor holds ``46 + 16 * num_workers`` words and records every
    argument and a hash of every length array; ``flash_attn`` refuses it for a call that differs.
    One metadata serves every layer that shares these arguments.

    ``deterministic=True`` splits key ranges only at fixed multiples of 1024 keys and merges the
    parts in a fixed order, so each sequence's result is bitwise identical whatever the rest of
    the batch and whatever ``num_workers``. See docs/ops/flash_attn.md.

    With MindSpore length tensors (or ``OPMESH_PLATFORM=mindspore``) the plan is a MindSpore
    tensor, and ``num_workers`` defaults to the binding's thread count (docs/mindspore.md).

    ``backward=True`` plans the call's backward instead (``torch.ops.opmesh.flash_attn_backward``
    takes it as ``metadata``): key blocks and query tiles cut into balanced contiguous ranges,
    one pair per worker; its gradients are bitwise the same for any plan and thread count.
    """
    layout_kv = layout_q if layout_kv is None else layout_kv
    layout_out = layout_q if layout_out is None else layout_out
    kwargs = dict(locals())
    check_scalar_types("flash_attn_metadata", kwargs)
    for name in positional("flash_attn_metadata"):
        del kwargs[name]
    if _on_mindspore(*_pick(kwargs, ATTN_LENGTHS)) or _platform.current().name == "mindspore":
        return _ms.flash_attn_metadata(num_heads_q, num_heads_kv, head_dim, kwargs)
    for name in ATTN_LENGTHS:
        kwargs[name] = _as_int32(kwargs[name], name)
    return torch.ops.opmesh.flash_attn_metadata(num_heads_q, num_heads_kv, head_dim, **kwargs)


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    cu_seqlens_q: LengthsLike = None,
    cu_seqlens_kv: LengthsLike = None,
    seqused_q: LengthsLike = None,
    seqused_kv: LengthsLike = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    metadata: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    mask_mode: int = 0,
    win_left: int = -1,
    win_right: int = -1,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    layout_q: str = "BSND",
    layout_kv: str | None = None,
    layout_out: str | None = None,
    return_softmax_lse: bool = False,
    context_parallel: str | tuple[str, str] = "all_gather",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Attention forward with GQA, variable lengths, paged keys/values, windows and sinks.

    For query head ``h`` (key head ``h // (Nq // Nkv)``), query position ``i`` and visible key
    ``j`` of a sequence with ``s1`` queries and ``s2`` keys::

        s_ij = softmax_scale * q_i . k_j
        s_ij = softcap * tanh(s_ij / softcap)   (softcap > 0 only)
        s_ij = s_ij - slope_h * |i + s2 - s1 - j|   (alibi_slopes only)
        m_i  = max(sink_h, max_j s_ij)          (no sink: max_j s_ij)
        out_i = sum_j exp(s_ij - m_i) v_j / (sum_j exp(s_ij - m_i) + exp(sink_h - m_i))
        lse_i = m_i + log(sum_j exp(s_ij - m_i) + exp(sink_h - m_i))

    Visibility (``mask_mode``): 0 every key; 3 causal aligned bottom-right (``j <= i + s2 - s1``);
    4 window ``i + s2 - s1 - win_left <= j <= i + s2 - s1 + win_right`` (-1: unbounded side).
    A row that sees no key gets output 0 and lse ``+inf`` (with a sink: the sink logit); query
    rows past ``seqused_q`` are padding with output 0 and lse ``+inf``.

    Args:
        q: ``[B, S1, Nq, D]`` (BSND), ``[B, Nq, S1, D]`` (BNSD) or ``[T1, Nq, D]`` (TND);
            float32, bfloat16, float16 (or float64, computed in float32).
        k, v: the same layout as q with ``Nkv`` heads (``Nq % Nkv == 0``), ``v`` with head dim
            ``Dv``; or paged ``[num_blocks, block_size, Nkv, D]`` (``layout_kv="PA_BBND"``).
        block_table: int32 ``[B, max_blocks_per_seq]``; key ``j`` of sequence ``b`` lives in
            block ``block_table[b, j // block_size]`` at slot ``j % block_size``. Paged only.
        cu_seqlens_q, cu_seqlens_kv: int32 ``[B + 1]`` cumulative lengths from 0, last entry the
            token count; required for TND and rejected otherwise.
        seqused_q, seqused_kv: int32 ``[B]`` lengths in use; with cu_seqlens the shorter wins.
            ``seqused_kv`` is required for paged keys/values.
        sinks: float32 ``[Nq]``, one logit per query head added to the softmax denominator.
        softcap: logit soft-capping (as Gemma 2 and flash-attn): a finite value ``>= 0``; None
            or 0 leaves the scores as they are.
        alibi_slopes: float32 ``[Nq]`` or ``[B, Nq]`` (per sequence for TND), flash-attn's ALiBi
            bias; the slopes get no gradient (a slopes tensor that requires one is refused).
        k_scale, v_scale: float32 row scales of a quantized cache (k and v int8 or
            ``float8_e4m3fn``, as :func:`kv_cache_write_` writes them), shaped as k and v without
            their head dim (paged: ``[num_blocks, block_size, Nkv]``); element ``e`` of a row
            reads as ``k[..., e] * k_scale[...]``. Each key tile is dequantized to q's dtype as
            it is read; decode only (no backward: a q that requires a gradient is refused).
        metadata: a :func:`flash_attn_metadata` plan for exactly these arguments; None plans here.
        softmax_scale: default ``1 / sqrt(D)``.
        max_seqlen_q, max_seqlen_kv: fixed by the shape for BSND/BNSD (a given value must agree);
            for TND and paged, the planned maximum (default: the longest sequence, or the
            metadata's).
        layout_q, layout_kv: the layouts of q and of k/v. ``layout_kv`` defaults to
            ``"PA_BBND"`` when a ``block_table`` is given, else to ``layout_q``.
        layout_out: the output's layout, ``layout_q`` by default: ``"TND"`` for TND queries,
            else ``"BSND"`` or ``"BNSD"``.
        return_softmax_lse: also return the float32 lse, ``[B, Nq, S1]`` or ``[Nq, T1]``;
            otherwise the second output is empty.
        context_parallel: with DTensors whose query sequence is sharded, how keys and values
            reach every rank: ``"all_gather"`` (gathered once) or ``"ring"`` (passed around the
            group while each rank computes, partial results merged by log-sum-exp),
            ``"ulysses"`` (q, k and v exchanged all-to-all into full sequences sharded by
            heads, and the output back), or ``("ulysses", "ring")`` / ``("ulysses",
            "all_gather")`` for a sequence sharded over two mesh axes (Ulysses over the first);
            see docs/distributed.md. No effect on plain tensors.

    Returns:
        ``(attn_out, softmax_lse)``; ``attn_out`` has q's dtype and head dim ``Dv``.

    MindSpore tensors in, MindSpore tensors out, differentiable through MindSpore's autograd
    (docs/mindspore.md).
    """
    if layout_kv is None:
        layout_kv = "PA_BBND" if block_table is not None else layout_q
    if layout_out is None:
        layout_out = layout_q
    if isinstance(context_parallel, list):
        context_parallel = tuple(context_parallel)
    if context_parallel not in _CONTEXT_PARALLEL:
        raise ValueError(
            "context_parallel: expected 'all_gather', 'ring', 'ulysses', ('ulysses', 'ring') or "
            f"('ulysses', 'all_gather'), got {context_parallel!r}"
        )
    call = dict(locals())
    check_scalar_types("flash_attn", call)
    del call["context_parallel"]
    if softcap is None or softcap == 0.0:
        # The schema's default. The Python default is None, not 0.0: under dynamic=True Dynamo
        # traces a float default as a symbolic float, and a guard on it restarts the analysis.
        del call["softcap"]
    if _on_mindspore(q, k, v):
        return _ms.flash_attn(q, k, v, {n: x for n, x in call.items() if n not in ("q", "k", "v")})
    for name in ATTN_LENGTHS:
        call[name] = _as_int32(call[name], name)
    # On a device mesh: the layout rules of opmesh/distributed/ops/flash_attn.py, then the
    # operator (and its autograd) on each rank's local tensors.
    return _run("flash_attn", call, context_parallel=context_parallel)


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    layout: str = "BSND",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines two partial attention results over disjoint key sets into the result over their
    union: ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) out_a +
    exp(lse_b - lse) out_b``. ``out_*`` and ``lse_*`` are shaped as :func:`flash_attn` returns
    them for ``layout`` (BSND ``[B, S, N, Dv]`` with ``[B, N, S]``, BNSD ``[B, N, S, Dv]`` with
    ``[B, N, S]``, TND ``[T, N, Dv]`` with ``[N, T]``); ``lse`` float32. A row whose lse is
    ``+inf`` (flash_attn's mark of a row that saw no key) counts as empty; a row empty in both
    stays output 0, lse ``+inf``. Differentiable in all four inputs, and compiled alike."""
    if _on_mindspore(out_a, lse_a, out_b, lse_b):
        raise NotImplementedError(
            "out_a: merge_attn_states takes PyTorch tensors only; on MindSpore, partial results "
            "come from the distributed layer, which runs on PyTorch (docs/mindspore.md)"
        )
    return torch.ops.opmesh.merge_attn_states(out_a, lse_a, out_b, lse_b, layout=layout)


def describe_metadata(metadata: torch.Tensor) -> dict:
    """A plan's summary as a dict.

    Costs are modelled nanoseconds (the planner's calibrated cost model, not measured time):
    ``worker_cost`` (one entry per logical worker), ``makespan`` (the largest worker cost),
    ``lower_bound`` (``max(total_cost / num_workers, largest indivisible task)``) and
    ``total_cost``. Counts: ``num_workers``, ``num_tasks``, ``num_splits``, ``num_slots``. Sizes in
    keys/rows/positions: ``split_keys``, ``key_tile``, ``rows_per_tile``,
    ``query_positions_per_tile``. Also the planned arguments, each worker's stretch
    (``workers``) and the combine tasks (``combines``)."""
    if _on_mindspore(metadata):
        metadata = torch.from_numpy(metadata.asnumpy())
    if not isinstance(metadata, torch.Tensor) or metadata.dtype != torch.int32:
        raise TypeError("metadata: expected the int32 tensor flash_attn_metadata returns")
    if metadata.dim() != 1:
        raise ValueError(f"metadata: expected a 1-D tensor, got shape {tuple(metadata.shape)}")
    if metadata.numel() and int(metadata[0]) == _MLA_PLAN_MAGIC:
        return _C._describe_mla_metadata(plan_bytes(metadata))
    return _C._describe_metadata(plan_bytes(metadata))


# The first word of a sparse_flash_mla_metadata plan ("OMLM"); such a plan's summary has
# num_workers, rows, makespan, lower_bound, total_cost (the predicted work, in key-dim products)
# and each worker's ((begin unit, begin key), (end unit, end key), cost).
_MLA_PLAN_MAGIC = 0x4D4C4D4F


def plan_bytes(metadata: torch.Tensor) -> bytes:
    """The words of a plan as bytes, for the extension's plan readers (no numpy needed)."""
    return array.array("i", metadata.detach().cpu().tolist()).tobytes()


def kv_cache_write_(
    key: torch.Tensor,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    slot_mapping: LengthsLike,
    *,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Writes this step's keys and values into a paged cache, in place.

    Token ``t`` goes to slot ``slot_mapping[t] = block * block_size + offset`` of both caches,
    ``key_cache[block, offset] = key[t]``; ``-1`` skips the token (padding). Every slot is checked
    (``-1 <= slot < num_blocks * block_size``, none written twice) before anything is written.
    The written memory must be the caches' own: a cache whose elements share memory (an
    expanded tensor), caches that overlap each other, and a ``key``, ``value`` or
    ``slot_mapping`` that overlaps a cache are refused, as PyTorch's in-place ops refuse them
    (internal overlap, and full or partial overlap of dense tensors; strided views whose overlap
    is too costly to decide pass, as they do in PyTorch). Under grad mode, arguments that require
    a gradient are refused: the write has no backward.
    Both caches' version counters advance, as for PyTorch's in-place ops, and under
    ``torch.compile`` the op is functionalized and written back in place (docs/graph_mode.md).

    A quantized cache (both caches int8 or ``float8_e4m3fn``, with ``key_scale`` and
    ``value_scale``) stores each (token, head) row as bytes and one float32 scale: ``scale =
    max|x| / 127`` (int8) or ``/ 448`` (fp8), each element the nearest value of ``x / scale``
    (ties to even); a row of zeros has scale 0, a row holding a NaN or an infinity a NaN scale
    (it reads back as NaN). :func:`flash_attn` reads it back with ``k_scale`` / ``v_scale``.

    With ``value`` and ``value_cache`` both None, the call writes one cache of rows read as key
    and value (DeepSeek's latent cache, read by :func:`sparse_flash_attention` and
    :func:`sparse_flash_mla`): ``key`` into ``key_cache``, a quantized one with ``key_scale``.

    Args:
        key: ``[T, Nkv, D]``; value: ``[T, Nkv, Dv]`` or None; the caches' dtype, or any
            floating dtype for a quantized cache.
        key_cache: ``[num_blocks, block_size, Nkv, D]`` (``PA_BBND``), mutated.
        value_cache: ``[num_blocks, block_size, Nkv, Dv]`` or None (with value), mutated.
        slot_mapping: int32/int64 ``[T]`` (a list is accepted).
        key_scale, value_scale: float32 ``[num_blocks, block_size, Nkv]``, mutated; required
            with a quantized cache (value_scale with a value_cache), refused otherwise.

    On MindSpore tensors the caches must be contiguous (docs/mindspore.md).
    """
    if _on_mindspore(key, value, key_cache, value_cache):
        _ms.kv_cache_write_(
            key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale
        )
        return
    torch.ops.opmesh.kv_cache_write_(
        key,
        value,
        key_cache,
        value_cache,
        _as_lengths(slot_mapping, "slot_mapping"),
        key_scale=key_scale,
        value_scale=value_scale,
    )
