"""flash-attn's calling conventions over opmesh's operators.

``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` take the
argument names, defaults and return conventions of the flash-attn package, so code written for it
runs here by changing the import::

    from opmesh.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

Every call goes to :func:`opmesh.flash_attn` (and, for the cache append, to
:func:`opmesh.kv_cache_write_`); these functions only translate arguments. The mapping:

* ``causal=True`` is opmesh's ``mask_mode=3`` (aligned bottom-right, as flash-attn 2.1 and later);
* ``window_size=(left, right)`` with a side other than -1 is ``mask_mode=4`` with
  ``win_left=left, win_right=right`` (``right`` is 0 when ``causal``);
* a dense cache ``[B_cache, S_cache, Hk, D]`` is a paged cache with one block of ``S_cache`` slots
  per sequence, so both kinds run the paged kernel.

``softcap`` (scores become ``softcap * tanh(score / softcap)``) and ``alibi_slopes`` (float32
``[H]`` or ``[B, H]``: ``-slope * |i + Sk - Sq - j|`` added to the score of query ``i`` and key
``j``) are opmesh's arguments of the same names, with gradients (the slopes themselves get none).
Features opmesh does not have raise ``NotImplementedError`` naming the argument:
``dropout_p > 0``, rotary embedding in the cache call (``rotary_cos`` / ``rotary_sin``) and
``cache_leftpad``. ``deterministic`` is accepted and changes nothing: a call gives the
same bits every time on the same thread count, forward and backward (across thread counts they
agree up to rounding, unless :func:`opmesh.flash_attn` runs on a plan made with
``flash_attn_metadata(..., deterministic=True)``). Gradients flow wherever
:func:`opmesh.flash_attn` has a backward (not through paged caches).
"""

from __future__ import annotations

import torch

from . import ops

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _unsupported(**features):
    """Raises NotImplementedError for the first feature given a value opmesh cannot honour."""
    for name, (value, default) in features.items():
        if value is not None and value != default:
            raise NotImplementedError(
                f"{name}: opmesh's flash attention does not implement it (got {value!r}); "
                f"leave it at {default!r}"
            )


def _options(causal, window_size, softmax_scale, sinks, softcap, alibi_slopes) -> dict:
    """flash_attn's keyword arguments for flash-attn's score and mask options."""
    mode, left, right = _mask(causal, window_size)
    return dict(
        softmax_scale=softmax_scale, mask_mode=mode, win_left=left, win_right=right, sinks=sinks,
        softcap=softcap, alibi_slopes=alibi_slopes,
    )  # fmt: skip


def _mask(causal, window_size):
    """(mask_mode, win_left, win_right) for flash-attn's causal and window_size."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size: expected a pair (left, right) of ints, got {window_size!r}"
        ) from None
    for side, value in (("left", left), ("right", right)):
        if value < -1:
            raise ValueError(f"window_size: the {side} side must be >= -1, got {value}")
    if causal:
        right = 0
    if left == -1 and right == -1:
        return 0, -1, -1
    if left == -1 and right == 0:
        return 3, -1, -1
    return 4, left, right


def _int32(value, name):
    """An int32 tensor of lengths or indices: any integer tensor or a list, through the same
    conversion (and int32 range check) as opmesh.flash_attn's."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {value.dtype}")
        if value.dtype not in (torch.int32, torch.int64):
            value = value.to(torch.int64)
    return ops._as_int32(value, name)


def _returns(out, lse, return_softmax_lse, return_attn_probs):
    if return_attn_probs:
        return out, lse, None  # flash-attn's third output (dropout pattern) has no meaning here
    if return_softmax_lse:
        return out, lse
    return out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Attention over ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hk, D]`` (GQA when ``Hk < H``).

    Returns ``out [B, Sq, H, Dv]``; with ``return_softmax_lse=True`` also the float32 lse
    ``[B, H, Sq]``; with ``return_attn_probs=True`` ``(out, lse, None)`` as flash-attn returns
    them. ``sinks`` (float32 ``[H]``) adds one logit per head to the softmax denominator.
    """
    _unsupported(dropout_p=(dropout_p, 0.0))
    options = _options(causal, window_size, softmax_scale, sinks, softcap, alibi_slopes)
    lse_wanted = return_softmax_lse or return_attn_probs
    out, lse = ops.flash_attn(q, k, v, return_softmax_lse=lse_wanted, **options)
    return _returns(out, lse, return_softmax_lse, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    return_softmax_lse: bool = False,
    seqused_k: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
):
    """Variable-length attention: ``q [Tq, H, D]``, ``k, v [Tk, Hk, D]`` packed, sequence ``b``
    at ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int32, from 0); or paged ``k, v`` ``[num_blocks,
    block_size, Hk, D]`` with ``block_table [B, max_blocks]`` (the key lengths from
    ``cu_seqlens_k`` differences, or ``seqused_k``).

    Returns ``out [Tq, H, Dv]``; with ``return_softmax_lse=True`` also the lse ``[H, Tq]``; with
    ``return_attn_probs=True`` ``(out, lse, None)``.
    """
    _unsupported(dropout_p=(dropout_p, 0.0))
    options = _options(causal, window_size, softmax_scale, sinks, softcap, alibi_slopes)
    options.update(
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_k,
        layout_q="TND",
        layout_out="TND",
        return_softmax_lse=return_softmax_lse or return_attn_probs,
    )
    if block_table is not None:
        if seqused_k is None:
            if cu_seqlens_k is None:
                raise ValueError(
                    "seqused_k: a paged cache needs the keys per sequence, as seqused_k or as "
                    "cu_seqlens_k"
                )
            cu = _int32(cu_seqlens_k, "cu_seqlens_k")
            seqused_k = (cu[1:] - cu[:-1]).to(torch.int32)
        out, lse = ops.flash_attn(
            q,
            k,
            v,
            block_table=block_table,
            cu_seqlens_q=_int32(cu_seqlens_q, "cu_seqlens_q"),
            seqused_kv=_int32(seqused_k, "seqused_k"),
            layout_kv="PA_BBND",
            **options,
        )
    else:
        out, lse = ops.flash_attn(
            q,
            k,
            v,
            cu_seqlens_q=_int32(cu_seqlens_q, "cu_seqlens_q"),
            cu_seqlens_kv=_int32(cu_seqlens_k, "cu_seqlens_k"),
            seqused_kv=None if seqused_k is None else _int32(seqused_k, "seqused_k"),
            layout_kv="TND",
            **options,
        )
    return _returns(out, lse, return_softmax_lse, return_attn_probs)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: torch.Tensor | None = None,
):
    """Attention of ``q [B, Sq, H, D]`` to a key/value cache, appending ``k, v [B, Sk_new, Hk,
    D]`` to it in place first (at positions ``cache_seqlens[b]`` onwards).

    The cache is dense ``[B_cache, S_cache, Hk, D]`` (sequence ``b`` in row
    ``cache_batch_idx[b]``, default ``b``) or paged ``[num_blocks, block_size, Hk, D]`` with
    ``block_table [B, max_blocks]``. ``cache_seqlens`` (int32 ``[B]`` or one int) are the
    lengths before the append; attention sees ``cache_seqlens + Sk_new`` keys (the whole cache
    when None). ``num_splits`` is accepted and ignored (opmesh plans its own split).

    Returns ``out [B, Sq, H, Dv]``, and the lse ``[B, H, Sq]`` with ``return_softmax_lse=True``.
    """
    _unsupported(
        rotary_cos=(rotary_cos, None),
        rotary_sin=(rotary_sin, None),
        cache_leftpad=(cache_leftpad, None),
    )
    if (k is None) != (v is None):
        raise ValueError("k: k and v are appended together; pass both or neither")
    batch = q.shape[0]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not supported with a block_table (paged cache)")
        block_size = k_cache.shape[1]
        table = block_table
    else:
        # A dense cache is a paged one with one block of S_cache slots per sequence.
        block_size = k_cache.shape[1]
        rows = (
            torch.arange(batch, dtype=torch.int32)
            if cache_batch_idx is None
            else _int32(cache_batch_idx, "cache_batch_idx")
        )
        if rows.dim() != 1 or rows.shape[0] != batch:
            raise ValueError(
                f"cache_batch_idx: expected {batch} entries (one per sequence of q), got shape "
                f"{tuple(rows.shape)}"
            )
        table = rows.view(batch, 1)
    if cache_seqlens is None:
        lengths = torch.full((batch,), table.shape[1] * block_size, dtype=torch.int32)
        if k is not None:
            raise ValueError("cache_seqlens: required to append k and v to the cache")
    elif isinstance(cache_seqlens, int):
        lengths = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    else:
        lengths = _int32(cache_seqlens, "cache_seqlens")
    if k is not None:
        new = k.shape[1]
        capacity = table.shape[1] * block_size
        if int(lengths.max()) + new > capacity if batch else False:
            raise ValueError(
                f"k: appending {new} tokens to sequences of up to {int(lengths.max())} exceeds the "
                f"cache's {capacity} slots per sequence"
            )
        positions = lengths.to(torch.int64).view(batch, 1) + torch.arange(new).view(1, new)
        blocks = table.to(torch.int64).gather(1, positions // block_size)
        slots = (blocks * block_size + positions % block_size).flatten()
        ops.kv_cache_write_(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots)
        lengths = lengths + new
    out, lse = ops.flash_attn(
        q,
        k_cache,
        v_cache,
        block_table=table.to(torch.int32),
        seqused_kv=lengths.to(torch.int32),
        **_options(causal, window_size, softmax_scale, sinks, softcap, alibi_slopes),
        layout_kv="PA_BBND",
        return_softmax_lse=return_softmax_lse,
    )
    return (out, lse) if return_softmax_lse else out
