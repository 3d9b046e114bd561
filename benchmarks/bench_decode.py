"""Decoding at the memory's limit: flash_attn on a paged bf16 cache (PA_BBND, block 64) against
the rate this machine streams the same bytes, and against scaled_dot_product_attention, in one
run.

Decoding reads every cached key and value once per step, so its bound is the memory: the
streaming rate is measured here as a plain sum over the cache's own tensors (``k.sum()`` and
``v.sum()``, every byte read once). Each row reports the cache read rate of the decode step
(cache bytes / time), its share of the streaming rate, and for the many-heads case the bound
that binds: the byte bound (cache bytes / streaming rate) or the FLOP bound (4 * Nq * S_q * S2 *
D flops at the GFLOP/s of a ``torch.mm`` of the tier's matmul dtype measured in the same run:
bf16, or float32 on a SIMD level without bf16 products).

* Heads 32/8, 8/1 and 64/1 (D = 128); 8192 and 32768 cached tokens; batch 1 and 8 (a batch of
  one runs one long sequence, split across the workers by the plan).
* S_q = 1 (one-token decode) and S_q = 16 (speculative decoding, chunked prefill; causal,
  the queries at the end of the keys).
* The same call with every block table pointing at the first 4 blocks of the pool ("in-cache
  GB/s"): the bytes read stay in the core's cache, so its rate is the kernel's own, the rate the
  decode would reach if memory kept up.
* SDPA takes the same cache as a dense [B, H, S, D] tensor (``enable_gqa``; a bottom-right
  boolean mask for S_q = 16), as a user without a paged kernel would.
* The streaming sum, the decode, the in-cache decode and SDPA are timed in turn, three rounds,
  and each reports the median of its rounds: on a shared machine the rates drift by 10-20 %
  within a minute, and timing them one after another would put that drift into the ratios.

With ``--cache int8`` or ``--cache fp8`` the decode reads a quantized copy of the cache (written
by ``kv_cache_write_``: one byte per element and a float32 scale per row and head): its bytes
(scales included) are what the read rate and the share of the streaming rate count, the bf16
decode of the same step runs beside it ("bf16 ms"), and SDPA reads the dequantized cache.

With ``--huge-pages`` each row also runs on a copy of the cache in transparent huge pages (2 MiB
pages: private memory advised with MADV_HUGEPAGE, as torch's allocator advises its large blocks
under ``THP_MEM_ALLOC_ENABLE=1``), the streaming sum too, timed in turn with the others: the
"huge-page" columns, and the decode's speed-up from the pages. The header gives the kernel's
transparent huge page mode and the least share of a copy that the kernel backed with huge pages.

    python benchmarks/bench_decode.py [--contexts 8192 32768] [--batches 1 8] [--queries 1 16]
        [--cache bf16|int8|fp8] [--huge-pages]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    in_huge_pages,
    interleaved,
    tier_matmul_dtype,
    time_call,
    transparent_huge_pages,
    write_results,
)

import opmesh  # noqa: E402

D, BLOCK = 128, 64
HEADS = [(32, 8), (8, 1), (64, 1)]


def paged_inputs(batch, context, nq, nkv, sq, gen):
    blocks_per_seq = context // BLOCK
    blocks = batch * blocks_per_seq
    k = torch.randn(blocks, BLOCK, nkv, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(blocks, BLOCK, nkv, D, generator=gen).to(torch.bfloat16)
    # Blocks of a sequence scattered over the pool, as a serving cache holds them.
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    q = torch.randn(batch, sq, nq, D, generator=gen).to(torch.bfloat16)
    lengths = torch.full((batch,), context, dtype=torch.int32)
    return q, k, v, table, lengths


def dense_cache(k, v, table):
    """The paged cache as dense [B, Nkv, S, D] tensors for SDPA."""
    batch = table.shape[0]
    kd = k[table.long()].reshape(batch, -1, k.shape[2], D).transpose(1, 2).contiguous()
    vd = v[table.long()].reshape(batch, -1, v.shape[2], D).transpose(1, 2).contiguous()
    return kd, vd


def quantized_cache(k, v, fmt):
    """k and v written by kv_cache_write_ into a cache of `fmt` (int8, float8_e4m3fn), with
    their scales, and the bf16 values that cache stands for."""
    blocks, block, nkv, d = k.shape
    caches = [torch.empty(blocks, block, nkv, d, dtype=fmt) for _ in range(2)]
    scales = [torch.empty(blocks, block, nkv) for _ in range(2)]
    slots = torch.arange(blocks * block)
    opmesh.kv_cache_write_(
        k.flatten(0, 1), v.flatten(0, 1), *caches, slots, key_scale=scales[0], value_scale=scales[1]
    )
    values = [(c.float() * s[..., None]).bfloat16() for c, s in zip(caches, scales, strict=True)]
    return caches, scales, values


def stream_sum(k, v):
    return k.sum(), v.sum()


def step_opmesh(q, k, v, table, lengths, scales=None):
    quantized = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    return opmesh.flash_attn(
        q, k, v, block_table=table, seqused_kv=lengths, layout_kv="PA_BBND",
        mask_mode=3 if q.shape[1] > 1 else 0, **quantized,
    )[0]  # fmt: skip


def step_sdpa(qt, kd, vd, mask):
    return F.scaled_dot_product_attention(qt, kd, vd, attn_mask=mask, enable_gqa=True)


def bottom_right(sq, context):
    """The causal mask of sq queries at the end of `context` keys (None for one query)."""
    if sq == 1:
        return None
    return torch.arange(context).view(1, context) <= torch.arange(sq).view(sq, 1) + context - sq


def mm_gflops():
    dtype = tier_matmul_dtype(torch.bfloat16)
    a = torch.randn(2048, 2048).to(dtype)
    b = torch.randn(2048, 2048).to(dtype)
    return 2 * 2048**3 / time_call(lambda: torch.mm(a, b), budget_s=1.0) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per call")
    parser.add_argument("--cache", choices=["bf16", "int8", "fp8"], default="bf16")
    parser.add_argument(
        "--huge-pages", action="store_true", help="also decode from a copy in huge pages"
    )
    args = parser.parse_args()
    if args.huge_pages and transparent_huge_pages() in (None, "never"):
        parser.error("--huge-pages: this kernel gives no transparent huge pages")
    shares = []  # the share of each huge-page copy that the kernel backed with huge pages
    fmt = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(args.cache)
    gen = torch.Generator().manual_seed(0)
    peak = mm_gflops()
    rows = []
    for nq, nkv in HEADS:
        for context in args.contexts:
            for batch in args.batches:
                _, k, v, table, lengths = paged_inputs(batch, context, nq, nkv, 1, gen)
                stream_bytes = cache_bytes = 2 * k.numel() * k.element_size()
                stream_fn = partial(stream_sum, k, v)
                plain = (k, v, None)
                if args.huge_pages:
                    (hk, share_k), (hv, share_v) = in_huge_pages(k), in_huge_pages(v)
                    huge_stream = partial(stream_sum, hk, hv)
                    shares += [share_k, share_v]
                if fmt is not None:
                    (kq, vq), scales, (k, v) = quantized_cache(k, v, fmt)
                    cache_bytes = 2 * kq.numel() + sum(s.numel() * 4 for s in scales)
                    if args.huge_pages:
                        (hk, share_k), (hv, share_v) = in_huge_pages(kq), in_huge_pages(vq)
                        shares += [share_k, share_v]
                kd, vd = dense_cache(k, v, table)
                for sq in args.queries:
                    q = torch.randn(batch, sq, nq, D, generator=gen).to(torch.bfloat16)
                    read = plain if fmt is None else (kq, vq, scales)
                    ours = partial(step_opmesh, q, *read[:2], table, lengths, read[2])
                    sdpa = partial(step_sdpa, q.transpose(1, 2), kd, vd, bottom_right(sq, context))
                    got = ours().float()
                    want = sdpa().transpose(1, 2).float()
                    error = float((got - want).abs().max())
                    cached = partial(step_opmesh, q, *read[:2], table % 4, lengths, read[2])
                    calls = {"stream": stream_fn, "ours": ours, "cached": cached, "sdpa": sdpa}
                    if fmt is not None:
                        calls["bf16"] = partial(step_opmesh, q, *plain[:2], table, lengths)
                    if args.huge_pages:
                        calls["huge stream"] = huge_stream
                        calls["huge"] = partial(step_opmesh, q, hk, hv, table, lengths, read[2])
                        assert torch.equal(calls["huge"](), ours())  # the same bytes, other pages
                    measured = interleaved(list(calls.values()), budget_s=3 * args.budget)
                    times = dict(zip(calls, measured, strict=True))
                    stream, t_ours, t_cached = times["stream"], times["ours"], times["cached"]
                    t_sdpa = times["sdpa"]
                    stream_gbs = stream_bytes / stream / 1e9
                    flops = 4 * nq * sq * context * D * batch
                    byte_bound = cache_bytes / (stream_gbs * 1e9)
                    flop_bound = flops / (peak * 1e9)
                    bound = max(byte_bound, flop_bound)
                    rows.append(
                        {
                            "heads": f"{nq}/{nkv}",
                            "context": context,
                            "batch": batch,
                            "S_q": sq,
                            "cache MB": f"{cache_bytes / 1e6:.0f}",
                            "stream GB/s": f"{stream_gbs:.1f}",
                            "opmesh ms": f"{t_ours * 1e3:.2f}",
                            "opmesh GB/s": f"{cache_bytes / t_ours / 1e9:.1f}",
                            "% of stream": f"{100 * byte_bound / t_ours:.0f}%",
                            "in-cache GB/s": f"{cache_bytes / t_cached / 1e9:.1f}",
                            "bound": "bytes" if byte_bound >= flop_bound else "flops",
                            "x of bound": f"{t_ours / bound:.2f}",
                            "sdpa ms": f"{t_sdpa * 1e3:.2f}",
                            "vs sdpa": f"{t_sdpa / t_ours:.2f}x",
                            "max abs diff": f"{error:.1e}",
                        }
                    )
                    if fmt is not None:
                        rows[-1]["bf16 ms"] = f"{times['bf16'] * 1e3:.2f}"
                        rows[-1]["vs bf16"] = f"{times['bf16'] / t_ours:.2f}x"
                    if args.huge_pages:
                        huge_gbs = stream_bytes / times["huge stream"] / 1e9
                        huge_bound = cache_bytes / (huge_gbs * 1e9)
                        rows[-1].update(
                            {
                                "huge-page stream GB/s": f"{huge_gbs:.1f}",
                                "huge-page ms": f"{times['huge'] * 1e3:.2f}",
                                "huge-page % of stream": f"{100 * huge_bound / times['huge']:.0f}%",
                                "x from huge pages": f"{t_ours / times['huge']:.2f}",
                            }
                        )
                    print(rows[-1], flush=True)
    columns = list(rows[0])
    cache = "bf16" if fmt is None else f"{args.cache} (a byte per element, a float32 scale per row)"
    notes = [
        f"{cache} cache, bf16 queries, D = {D}, paged (PA_BBND, block {BLOCK}, blocks scattered "
        "over the pool). "
        "stream GB/s: k.sum() and v.sum() over the cache's own tensors, timed in turn with the "
        "calls of its row (three rounds, medians). % of stream: the "
        "decode's cache read rate over the streaming rate. in-cache GB/s: the same call with every "
        "block table pointing at 4 blocks (the bytes read stay in cache): the kernel's own rate. "
        "x of bound: time over the larger of "
        f"the byte bound and the FLOP bound (4 Nq S_q S2 D flops at {peak:.0f} GFLOP/s, a "
        f"{str(tier_matmul_dtype(torch.bfloat16)).removeprefix('torch.')} torch.mm measured in "
        "this run). SDPA reads the same cache made dense "
        "(enable_gqa; S_q = 16 with a bottom-right causal mask)."
        + (
            ""
            if fmt is None
            else " cache MB, opmesh GB/s and % of stream count the quantized cache's bytes "
            "(scales included); stream GB/s is measured on the bf16 cache; bf16 ms: the same "
            "decode on the bf16 cache; SDPA reads the dequantized cache."
        ),
    ]
    if args.huge_pages:
        notes.append(
            "Huge pages: each row's cache (and its streaming sum) also copied into memory advised "
            "for transparent huge pages (MADV_HUGEPAGE), timed in turn with the others; x from "
            "huge pages: opmesh ms over huge-page ms. The kernel's transparent huge page mode: "
            f"{transparent_huge_pages()}; at least {100 * min(shares):.0f}% of every copy's bytes "
            "lay in 2 MiB pages."
        )
    notes += ["", f"`.venv/bin/python {' '.join(['benchmarks/bench_decode.py', *sys.argv[1:]])}`"]
    name = ("decode" if fmt is None else f"decode_{args.cache}") + (
        "_huge_pages" if args.huge_pages else ""
    )
    print(write_results(name, rows, columns, notes))


if __name__ == "__main__":
    main()
