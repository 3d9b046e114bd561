"""A plan object for flash_attn: fixed once per step, run by every layer.

Made from what does not change between layers (heads, head dims, mask, scale, layout), planned
from what changes every step (the lengths and block table), then run on each layer's tensors::

    plan = opmesh.FlashAttnPlan(num_heads_q=32, num_heads_kv=8, head_dim=128, causal=True)
    plan.plan(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)        # once per step
    for layer in layers:
        out = plan.run(q[layer], k[layer], v[layer])          # every layer reuses the plan

For decoding into a paged cache, ``advance(n)`` grows every sequence by n tokens, re-plans, and
returns the cache slots the new tokens go to, for :func:`opmesh.kv_cache_write_`.
"""

from __future__ import annotations

import torch

from . import ops
from .flash_attn_interface import _mask


class FlashAttnPlan:
    """Everything :func:`opmesh.flash_attn` needs besides q, k and v.

    Args:
        num_heads_q, num_heads_kv, head_dim: the attention's shape (``head_dim_v`` defaults to
            ``head_dim``).
        causal, window_size: the mask, as flash-attn states it (``window_size=(left, right)``,
            -1 for an unbounded side; ``causal`` makes ``right`` 0); aligned bottom-right.
        softmax_scale: default ``1 / sqrt(head_dim)``.
        layout: the queries' layout, ``"BSND"``, ``"BNSD"`` or ``"TND"``; keys and values share
            it unless the plan has a block table (paged ``PA_BBND``).
        num_workers: logical workers of the plan (default: this process's threads).
    """

    def __init__(
        self,
        num_heads_q: int,
        num_heads_kv: int,
        head_dim: int,
        *,
        head_dim_v: int | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softmax_scale: float | None = None,
        layout: str = "BSND",
        num_workers: int | None = None,
    ):
        if layout not in ("BSND", "BNSD", "TND"):
            raise ValueError(f"layout: expected 'BSND', 'BNSD' or 'TND', got {layout!r}")
        self.num_heads_q, self.num_heads_kv = num_heads_q, num_heads_kv
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.mask_mode, self.win_left, self.win_right = _mask(causal, window_size)
        self.softmax_scale = softmax_scale
        self.layout = layout
        self.num_workers = num_workers
        self.metadata = None

    def plan(
        self,
        *,
        batch_size: int | None = None,
        seqlen_q: int | None = None,
        seqlen_kv: int | None = None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        seqused_kv=None,
        block_table: torch.Tensor | None = None,
        page_size: int | None = None,
    ) -> FlashAttnPlan:
        """Fixes this step's lengths and plans the work. BSND/BNSD take ``batch_size``,
        ``seqlen_q`` and ``seqlen_kv`` (and optionally ``seqused_kv``, int32 ``[B]``); TND takes
        ``cu_seqlens_q`` (and ``cu_seqlens_kv`` for packed keys). A paged cache takes
        ``block_table`` (int32 ``[B, max_blocks]``), ``seqused_kv`` (the keys per sequence) and,
        for :meth:`advance`, ``page_size`` (the cache's slots per block). Returns the plan."""
        self.block_table = block_table
        self.page_size = page_size
        self.cu_seqlens_q = ops._as_int32(cu_seqlens_q, "cu_seqlens_q")
        self.cu_seqlens_kv = ops._as_int32(cu_seqlens_kv, "cu_seqlens_kv")
        self.seqused_kv = ops._as_int32(seqused_kv, "seqused_kv")
        if self.layout == "TND":
            if self.cu_seqlens_q is None:
                raise ValueError("cu_seqlens_q: required to plan layout TND")
            q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
            batch_size = q_lens.numel()
            seqlen_q = int(q_lens.max()) if batch_size else 0
        elif batch_size is None or seqlen_q is None:
            raise ValueError(f"batch_size, seqlen_q: required to plan layout {self.layout}")
        if block_table is not None:
            if self.seqused_kv is None:
                raise ValueError("seqused_kv: required with a block_table (keys per sequence)")
            if block_table.shape[0] != batch_size:
                raise ValueError(
                    f"block_table: expected {batch_size} rows (one per sequence), got "
                    f"{block_table.shape[0]}"
                )
            self.layout_kv = "PA_BBND"
        else:
            self.layout_kv = self.layout
        if self.seqused_kv is not None:
            seqlen_kv = int(self.seqused_kv.max()) if self.seqused_kv.numel() else 0
        elif self.cu_seqlens_kv is not None:
            k_lens = self.cu_seqlens_kv[1:] - self.cu_seqlens_kv[:-1]
            seqlen_kv = int(k_lens.max()) if k_lens.numel() else 0
        elif seqlen_kv is None:
            raise ValueError(f"seqlen_kv: required to plan layout {self.layout}")
        self.batch_size, self.seqlen_q, self.seqlen_kv = batch_size, seqlen_q, seqlen_kv
        self.metadata = ops.flash_attn_metadata(
            self.num_heads_q,
            self.num_heads_kv,
            self.head_dim,
            head_dim_v=self.head_dim_v,
            batch_size=batch_size,
            max_seqlen_q=seqlen_q,
            max_seqlen_kv=seqlen_kv,
            num_workers=self.num_workers,
            **self._shared_arguments(),
        )
        return self

    def _shared_arguments(self) -> dict:
        """What flash_attn_metadata and flash_attn take alike: the lengths, mask and layouts."""
        return dict(
            cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_kv=self.cu_seqlens_kv,
            seqused_kv=self.seqused_kv, mask_mode=self.mask_mode, win_left=self.win_left,
            win_right=self.win_right, layout_q=self.layout, layout_kv=self.layout_kv,
            layout_out=self.layout,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
        return_softmax_lse: bool = False,
    ):
        """flash_attn on this layer's tensors with everything the plan fixed. Returns the
        output, or ``(out, lse)`` with ``return_softmax_lse=True``."""
        if self.metadata is None:
            raise ValueError("plan: call plan(...) with this step's lengths before run()")
        planned_maxima = self.layout == "TND" or self.block_table is not None
        out, lse = ops.flash_attn(
            q,
            k,
            v,
            block_table=self.block_table,
            sinks=sinks,
            metadata=self.metadata,
            softmax_scale=self.softmax_scale,
            max_seqlen_q=self.seqlen_q if planned_maxima else None,
            max_seqlen_kv=self.seqlen_kv if planned_maxima else None,
            return_softmax_lse=return_softmax_lse,
            **self._shared_arguments(),
        )
        return (out, lse) if return_softmax_lse else out

    def advance(self, tokens: int = 1) -> torch.Tensor:
        """Decoding into a paged cache: every sequence gains ``tokens`` keys. Returns the int64
        cache slots of the new tokens (``[B * tokens]``, sequence-major, for
        :func:`opmesh.kv_cache_write_`), then grows ``seqused_kv`` and re-plans."""
        if self.block_table is None or self.seqused_kv is None:
            raise ValueError("advance: needs a plan with a block_table and seqused_kv")
        if tokens < 1:
            raise ValueError(f"tokens: must be >= 1, got {tokens}")
        block_size = self.page_size
        if block_size is None:
            raise ValueError(
                "page_size: advance needs the cache's slots per block; pass it to plan"
            )
        positions = self.seqused_kv.to(torch.int64).view(-1, 1) + torch.arange(tokens).view(1, -1)
        capacity = self.block_table.shape[1] * block_size
        if positions.numel() and int(positions.max()) >= capacity:
            raise ValueError(
                f"tokens: {tokens} more tokens exceed the block table's {capacity} slots per "
                "sequence"
            )
        blocks = self.block_table.to(torch.int64).gather(1, positions // block_size)
        slots = (blocks * block_size + positions % block_size).flatten()
        self.plan(
            batch_size=self.batch_size,
            seqlen_q=self.seqlen_q,
            cu_seqlens_q=self.cu_seqlens_q,
            seqused_kv=self.seqused_kv + tokens,
            block_table=self.block_table,
            page_size=block_size,
        )
        return slots
