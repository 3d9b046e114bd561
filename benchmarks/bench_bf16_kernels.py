"""bf16 kernel sets at the avx512_bf16 level: bf16-pair dot products against float32 FMA, forced
through OPMESH_BF16_KERNELS, beside the measured choice and PyTorch's SDPA, for the three kinds
of call the choice distinguishes: dense causal prefill, the indexer (compute-bound), and decode
against a 4096-key cache (memory-bound; 1 and 16 queries, contiguous and paged KV).

    python benchmarks/bench_bf16_kernels.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_call, write_results  # noqa: E402

import opmesh  # noqa: E402


def with_kernels(setting, fn):
    saved = os.environ.get("OPMESH_BF16_KERNELS")
    os.environ["OPMESH_BF16_KERNELS"] = setting
    try:
        return time_call(fn, budget_s=2.0)
    finally:
        if saved is None:
            del os.environ["OPMESH_BF16_KERNELS"]
        else:
            os.environ["OPMESH_BF16_KERNELS"] = saved


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
    )


def decode_calls(sq):
    """FLOPs and the timed calls of a decode step: B=4, `sq` queries against 4096 keys."""
    bf = torch.bfloat16
    qd = torch.randn(4, sq, 32, 128, dtype=bf)
    kd = torch.randn(4, 4096, 8, 128, dtype=bf)
    cache = kd.reshape(4 * 64, 64, 8, 128)
    table = torch.arange(4 * 64, dtype=torch.int32).reshape(4, 64)
    paged = dict(layout_kv="PA_BBND", block_table=table, seqused_kv=[4096] * 4)
    fns = {
        setting: (lambda s=setting: with_kernels(s, lambda: opmesh.flash_attn(qd, kd, kd)))
        for setting in ("auto", "pairs", "fp32")
    }
    fns["auto, paged"] = lambda: with_kernels(
        "auto", lambda: opmesh.flash_attn(qd, cache, cache, **paged)
    )
    fns["sdpa (contiguous)"] = lambda: time_call(lambda: sdpa(qd, kd, kd, False), budget_s=2.0)
    return 4 * 4 * sq * 4096 * 32 * 128, fns


def main():
    if "avx512_bf16" not in opmesh.simd_levels():
        print("this CPU has no AVX-512 BF16: there is only one bf16 kernel set")
        return
    torch.manual_seed(0)
    bf = torch.bfloat16
    rows = []

    def add(call, flops, fns):
        times = {name: fn() for name, fn in fns.items()}
        best = min(times.values())
        for name, t in times.items():
            rows.append(
                {
                    "call": call,
                    "kernels": name,
                    "ms": f"{t * 1e3:.2f}",
                    "GFLOP/s": f"{flops / t / 1e9:.1f}",
                    "time / best": f"{t / best:.2f}",
                }
            )
        print(rows[-len(times) :])

    q = torch.randn(1, 2048, 32, 128, dtype=bf)
    k = torch.randn(1, 2048, 8, 128, dtype=bf)
    flops = 4 * 2048 * 2049 / 2 * 32 * 128
    add(
        "prefill causal, S=2048, 32/8 heads, D=128",
        flops,
        {
            setting: (
                lambda s=setting: with_kernels(s, lambda: opmesh.flash_attn(q, k, k, mask_mode=3))
            )
            for setting in ("auto", "pairs", "fp32")
        }
        | {"sdpa": lambda: time_call(lambda: sdpa(q, k, k, True), budget_s=2.0)},
    )
    qi = torch.randn(1, 2048, 64, 128, dtype=bf)
    ki = torch.randn(1, 2048, 1, 128, dtype=bf)
    wi = torch.randn(1, 2048, 64)
    add(
        "indexer causal, S=2048, 64 heads, D=128",
        2 * 2048 * 2049 / 2 * 64 * 128,
        {
            setting: (
                lambda s=setting: with_kernels(
                    s, lambda: opmesh.dense_lightning_indexer_softmax_lse(qi, ki, wi)
                )
            )
            for setting in ("auto", "pairs", "fp32")
        },
    )
    for sq in (1, 16):
        add(f"decode, B=4, {sq} queries x 4096 keys, 32/8 heads", *decode_calls(sq))
    write_results(
        "bf16_kernels",
        rows,
        ["call", "kernels", "ms", "GFLOP/s", "time / best"],
        notes=["`.venv/bin/python benchmarks/bench_bf16_kernels.py`"],
    )


if __name__ == "__main__":
    main()
