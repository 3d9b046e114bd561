"""Fake (shape-only) implementations registered from Python.

flash_attn_metadata may be called with no tensor argument at all, so a C++ Meta kernel has no
device to follow under FakeTensorMode; its plan is a CPU int32 tensor whose length depends on
num_workers only (the extension computes it, so the format stays defined in one place).
"""

from __future__ import annotations

import torch

from . import _C


@torch.library.register_fake("opmesh::flash_attn_metadata")
def _flash_attn_metadata_fake(
    num_heads_q,
    num_heads_kv,
    head_dim,
    *,
    head_dim_v=None,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    seqused_q=None,
    seqused_kv=None,
    batch_size,
    max_seqlen_q,
    max_seqlen_kv,
    mask_mode=0,
    win_left=-1,
    win_right=-1,
    layout_q="BSND",
    layout_kv="BSND",
    layout_out="BSND",
    num_workers=None,
    deterministic=False,
):
    workers = torch.get_num_threads() if num_workers is None else num_workers
    return torch.empty(_C._metadata_words(workers), dtype=torch.int32, device="cpu")
