"""Input builders and the designed case grid for flash_attn."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnCase:
    name: str
    layout_q: str
    layout_kv: str
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    nq: int
    nkv: int
    d: int
    dv: int | None = None
    mask_mode: int = 0
    win_left: int = -1
    win_right: int = -1
    sinks: bool = False
    s1: int | None = None  # BSND/BNSD padded lengths; shorter q_lens/k_lens become seqused
    s2: int | None = None
    block_size: int = 16
    layout_out: str | None = None
    q_used: tuple[int, ...] | None = None  # TND: seqused_q shorter than the cu_seqlens lengths
    k_used: tuple[int, ...] | None = None


# Every layout (BSND, BNSD, TND, paged PA_BBND with block sizes 16 and 64); decode with keys read
# in place; S1 < S2 and S1 > S2;
# varlen with empty sequences; windows 0, 1, large and -1 on each side; sinks; GQA 1/4/8; head
# dims 64, 128, (192, 128) and odd 17/33; seqused with and without cu_seqlens.
CASES = [
    AttnCase("dense_bsnd", "BSND", "BSND", (70, 70), (90, 90), 4, 1, 64),
    AttnCase("causal_more_keys", "BSND", "BSND", (37,), (150,), 2, 2, 128, mask_mode=3),
    AttnCase("causal_more_queries", "BSND", "BSND", (150, 150), (37, 37), 8, 1, 64, mask_mode=3),
    AttnCase("bnsd", "BNSD", "BNSD", (65, 65), (65, 65), 8, 2, 64, mask_mode=3, layout_out="BNSD"),
    AttnCase("bnsd_to_bsnd", "BNSD", "BNSD", (33,), (100,), 4, 4, 64, mask_mode=3),
    AttnCase("bsnd_to_bnsd", "BSND", "BSND", (20,), (20,), 4, 1, 64, layout_out="BNSD"),
    AttnCase(
        "tnd_varlen_empty",
        "TND",
        "TND",
        (17, 0, 111, 1, 64),
        (17, 5, 111, 0, 200),
        8,
        2,
        64,
        mask_mode=3,
    ),
    AttnCase("tnd_dv", "TND", "TND", (40, 90), (40, 130), 2, 2, 192, dv=128, mask_mode=3),
    AttnCase(
        "paged_16_decode",
        "BSND",
        "PA_BBND",
        (1, 1, 1),
        (100, 0, 333),
        8,
        1,
        128,
        mask_mode=3,
        block_size=16,
    ),
    AttnCase(
        "paged_64",
        "BSND",
        "PA_BBND",
        (40, 40, 40),
        (40, 170, 64),
        4,
        1,
        64,
        mask_mode=3,
        block_size=64,
    ),
    AttnCase("paged_tnd", "TND", "PA_BBND", (5, 0, 30), (50, 7, 30), 4, 2, 64, block_size=16),
    # Decode with bf16 keys read in place (one key head, at most 16 query rows per sequence,
    # whole 64-key blocks): 4, 8 and 16 rows; one block exactly, and partial last tiles inside a
    # block.
    AttnCase(
        "paged_64_decode",
        "BSND",
        "PA_BBND",
        (1, 2, 4),
        (200, 64, 130),
        4,
        1,
        128,
        mask_mode=3,
        block_size=64,
    ),
    # Unpaged decode: whole tiles in place, the last partial tile packed; a 12-row sequence
    # beside a 20-row one that packs every tile.
    AttnCase("decode_tnd", "TND", "TND", (3, 5), (150, 97), 4, 1, 64, mask_mode=3),
    AttnCase(
        "window_0_0", "BSND", "BSND", (80,), (80,), 4, 1, 64, mask_mode=4, win_left=0, win_right=0
    ),
    AttnCase(
        "window_1_1", "BSND", "BSND", (90,), (60,), 4, 4, 64, mask_mode=4, win_left=1, win_right=1
    ),
    AttnCase(
        "window_large",
        "BSND",
        "BSND",
        (50,),
        (70,),
        4,
        1,
        64,
        mask_mode=4,
        win_left=1000,
        win_right=1000,
    ),
    AttnCase(
        "window_left_only", "BSND", "BSND", (100,), (130,), 4, 1, 64, mask_mode=4, win_left=20
    ),
    AttnCase(
        "window_right_only", "BSND", "BSND", (100,), (70,), 4, 1, 64, mask_mode=4, win_right=5
    ),
    AttnCase(
        "window_sliding_tnd",
        "TND",
        "TND",
        (70, 3, 130),
        (70, 40, 130),
        8,
        1,
        64,
        mask_mode=4,
        win_left=33,
        win_right=0,
    ),
    AttnCase("sinks_causal", "BSND", "BSND", (90,), (30,), 4, 1, 64, mask_mode=3, sinks=True),
    AttnCase(
        "sinks_window_tnd",
        "TND",
        "TND",
        (50, 20),
        (50, 60),
        4,
        2,
        64,
        mask_mode=4,
        win_left=8,
        win_right=-1,
        sinks=True,
    ),
    AttnCase(
        "seqused_bsnd",
        "BSND",
        "BSND",
        (64, 10, 0),
        (64, 100, 5),
        4,
        1,
        64,
        s1=64,
        s2=100,
        mask_mode=3,
    ),
    AttnCase(
        "seqused_tnd",
        "TND",
        "TND",
        (40, 30),
        (50, 60),
        4,
        1,
        64,
        mask_mode=3,
        q_used=(25, 30),
        k_used=(50, 9),
    ),
    AttnCase("odd_dims", "BSND", "BSND", (29,), (45,), 4, 2, 17, dv=33, mask_mode=3),
    AttnCase("long_row", "BSND", "BSND", (3,), (2000,), 4, 1, 64),
    AttnCase("gqa8_128", "BSND", "BSND", (130,), (130,), 16, 2, 128, mask_mode=3),
    AttnCase("all_empty_q", "TND", "TND", (0, 0), (5, 0), 4, 1, 64, mask_mode=3),
]

BY_NAME = {c.name: c for c in CASES}

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (out atol, out rtol, lse atol, lse rtol). float32 differs from float64 by accumulation order
# and a polynomial exp (relative error < 1e-7). bfloat16 rounds the probabilities to bf16 before
# the product with V, as every flash kernel does, and the output to bf16 (2^-9 relative).
# float16 computes in float32 and rounds only the output (2^-11 relative). The lse comes from
# float32 scores of exactly represented inputs in every case.
TOLERANCES = {
    torch.float32: (2e-5, 1e-4, 2e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2, 2e-4, 1e-5),
    torch.float16: (2e-3, 2e-3, 2e-4, 1e-5),
    torch.float64: (2e-5, 1e-4, 2e-5, 1e-5),
}


def _cumulative(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _tensor(layout, batch, s, n, d, dtype, gen):
    shape = {"BSND": (batch, s, n, d), "BNSD": (batch, n, s, d), "TND": (s, n, d)}[layout]
    return torch.randn(shape, generator=gen).to(dtype)


def make_inputs(case: AttnCase, dtype=torch.float32, seed=0):
    """Returns (q, k, v, kwargs) for opmesh.flash_attn."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(case.q_lens)
    dv = case.dv or case.d
    kw = dict(
        mask_mode=case.mask_mode,
        win_left=case.win_left,
        win_right=case.win_right,
        layout_q=case.layout_q,
        layout_kv=case.layout_kv,
        layout_out=case.layout_out or ("TND" if case.layout_q == "TND" else "BSND"),
    )
    if case.layout_q == "TND":
        q = _tensor("TND", batch, sum(case.q_lens), case.nq, case.d, dtype, gen)
        kw["cu_seqlens_q"] = _cumulative(case.q_lens)
        if case.q_used is not None:
            kw["seqused_q"] = torch.tensor(case.q_used, dtype=torch.int32)
    else:
        s1 = case.s1 or max(case.q_lens)
        q = _tensor(case.layout_q, batch, s1, case.nq, case.d, dtype, gen)
        if any(n != s1 for n in case.q_lens):
            kw["seqused_q"] = torch.tensor(case.q_lens, dtype=torch.int32)
    if case.layout_kv == "TND":
        k = _tensor("TND", batch, sum(case.k_lens), case.nkv, case.d, dtype, gen)
        v = _tensor("TND", batch, sum(case.k_lens), case.nkv, dv, dtype, gen)
        kw["cu_seqlens_kv"] = _cumulative(case.k_lens)
        if case.k_used is not None:
            kw["seqused_kv"] = torch.tensor(case.k_used, dtype=torch.int32)
    elif case.layout_kv == "PA_BBND":
        bs = case.block_size
        need = [math.ceil(n / bs) for n in case.k_lens]
        num_blocks = sum(need) + 3  # spare blocks hold garbage that must never be read
        order = torch.randperm(num_blocks, generator=gen)
        width = max(max(need), 1) + 1
        table = torch.full((batch, width), num_blocks + 7, dtype=torch.int32)  # unused: invalid
        used = 0
        for b, n in enumerate(need):
            table[b, :n] = order[used : used + n].to(torch.int32)
            used += n
        k = torch.randn(num_blocks, bs, case.nkv, case.d, generator=gen).to(dtype)
        v = torch.randn(num_blocks, bs, case.nkv, dv, generator=gen).to(dtype)
        kw["block_table"] = table
        kw["seqused_kv"] = torch.tensor(case.k_lens, dtype=torch.int32)
    else:
        s2 = case.s2 or max(case.k_lens)
        k = _tensor(case.layout_kv, batch, s2, case.nkv, case.d, dtype, gen)
        v = _tensor(case.layout_kv, batch, s2, case.nkv, dv, dtype, gen)
        if any(n != s2 for n in case.k_lens):
            kw["seqused_kv"] = torch.tensor(case.k_lens, dtype=torch.int32)
    if case.sinks:
        kw["sinks"] = torch.randn(case.nq, generator=gen) * 2
    return q, k, v, kw


def metadata_kwargs(case: AttnCase, q, kw, **extra):
    """The flash_attn_metadata arguments that plan the call make_inputs describes."""
    batch = len(case.q_lens)
    if case.layout_q == "TND":
        max_q = max(case.q_lens, default=0)
    else:
        max_q = q.shape[1] if case.layout_q == "BSND" else q.shape[2]
    if case.layout_kv in ("TND", "PA_BBND"):
        max_k = max(case.k_lens, default=0)
    else:
        max_k = case.s2 or max(case.k_lens)
    out = dict(
        head_dim_v=case.dv or case.d,
        batch_size=batch,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_k,
        mask_mode=kw["mask_mode"],
        win_left=kw["win_left"],
        win_right=kw["win_right"],
        layout_q=kw["layout_q"],
        layout_kv=kw["layout_kv"],
        layout_out=kw["layout_out"],
    )
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv"):
        if name in kw:
            out[name] = kw[name]
    out.update(extra)
    return out
