"""flash_attn forward + backward against scaled_dot_product_attention's forward + backward (the
CPU flash kernels of PyTorch, with enable_gqa and with repeated key/value heads), in one run,
with the peak extra memory of each.

Causal, 32 query / 8 key heads, D = 128. A training step's attention: the forward, then the
gradients of q, k and v for a random output gradient.
1. Dense: B = 1, S in {2048, 4096}.
2. Heavy-tailed varlen: 32 sequences of lognormal lengths (mean 1000, the flash_attn benchmark's
   batch) in TND, against a loop of SDPA calls, one per sequence.
GFLOP/s count the forward's 4 * D and the backward's 10 * D flops per visible query-key pair and
head (the backward recomputes the scores: five products of the forward's size), so ratios are
time ratios. Peak extra memory: the rise of the process's resident size during one step.

    python benchmarks/bench_flash_attn_backward.py [--seqs 2048 4096] [--dtypes bf16 fp32]
        [--cases dense varlen]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flash_attn import sdpa_loop, varlen_inputs, varlen_lengths  # noqa: E402
from common import (  # noqa: E402
    best_on_this_tier,
    interleaved,
    peak_extra_bytes,
    tier_compositions,
    tier_matmul_dtype,
    write_results,
)

import opmesh  # noqa: E402

NQ, NKV, D = 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def step_opmesh(q, k, v, dout):
    out = opmesh.flash_attn(q, k, v, mask_mode=3)[0]
    return torch.autograd.grad(out, (q, k, v), dout)


def step_sdpa(q, k, v, dout, repeat):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if repeat:
        group = NQ // NKV
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    return torch.autograd.grad(out.transpose(1, 2), (q, k, v), dout)


def step_opmesh_varlen(q, k, v, dout, cu):
    out = opmesh.flash_attn(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, mask_mode=3, layout_q="TND",
        layout_kv="TND", layout_out="TND",
    )[0]  # fmt: skip
    return torch.autograd.grad(out, (q, k, v), dout)


def step_sdpa_varlen(q, k, v, dout, cu, lengths):
    out = sdpa_loop(q, k, v, cu, lengths)
    return torch.autograd.grad(out, (q, k, v), dout)


def measure(rows, name, label, flops, methods, budget):
    """Times each method (the first is opmesh), measures its peak extra memory, and appends the
    rows with ratios to the best of the others."""
    # Timed in turn over three rounds (one call each at least): this shared machine drifts by
    # 10-30 % within a minute, and the ratios should not carry that drift.
    # torch.mm of the tier's matmul dtype (float32 without bf16 products, else the inputs'),
    # timed in turn with the methods: the "% of mm" column.
    mm_dtype = tier_matmul_dtype(DTYPES[name])
    a, b = (torch.randn(4096, 4096).to(mm_dtype) for _ in range(2))
    *medians, mm_time = interleaved(
        [*methods.values(), partial(torch.mm, a, b)], budget_s=budget, min_repeats=1
    )
    mm = 2 * 4096**3 / mm_time / 1e9
    times = dict(zip(methods, medians, strict=True))
    memory = {m: peak_extra_bytes(fn) for m, fn in methods.items()}
    ours = next(iter(methods))
    best = times[best_on_this_tier(times, [ours])]
    for method, t in times.items():
        rows.append(
            {
                "dtype": name,
                "case": label,
                "method": method,
                "ms": f"{t * 1e3:.1f}",
                "GFLOP/s": f"{flops / t / 1e9:.1f}",
                "vs best SDPA": f"{best / t:.2f}x",
                "% of mm": f"{100 * flops / t / 1e9 / mm:.0f}%",
                "mm GFLOP/s": f"{mm:.0f}",
                "peak extra MiB": f"{memory[method] / 2**20:.1f}",
            }
        )
    print(rows[-len(methods) :], flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per method")
    parser.add_argument(
        "--cases", nargs="+", default=["dense", "varlen"], choices=["dense", "varlen"]
    )
    args = parser.parse_args()
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        for seq in args.seqs if "dense" in args.cases else []:
            g = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(1, seq, heads, D, generator=g).to(dtype).requires_grad_()
                for heads in (NQ, NKV, NKV)
            )
            dout = torch.randn(1, seq, NQ, D, generator=g).to(dtype)
            ours = step_opmesh(q, k, v, dout)
            ref = step_sdpa(q, k, v, dout, False)
            err = max(
                (a.float() - b.float()).abs().max().item() for a, b in zip(ours, ref, strict=True)
            )
            print(f"{name} S={seq}: max |grad - sdpa grad| = {err:.1e}", flush=True)
            measure(
                rows,
                name,
                f"dense S={seq}",
                14 * NQ * D * seq * (seq + 1) // 2,
                {
                    "opmesh": partial(step_opmesh, q, k, v, dout),
                    **tier_compositions("sdpa (enable_gqa)", step_sdpa, q, k, v, dout, False),
                    **tier_compositions("sdpa (repeated kv)", step_sdpa, q, k, v, dout, True),
                },
                args.budget,
            )
        if "varlen" not in args.cases:
            continue
        lengths = varlen_lengths()
        q, k, v, cu = varlen_inputs(lengths, dtype)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        measure(
            rows,
            name,
            f"varlen {len(lengths)} seqs, {sum(lengths)} tokens",
            sum(14 * NQ * D * n * (n + 1) // 2 for n in lengths),
            {
                "opmesh": partial(step_opmesh_varlen, q, k, v, dout, cu),
                **tier_compositions("sdpa loop", step_sdpa_varlen, q, k, v, dout, cu, lengths),
            },
            args.budget,
        )
    print(
        write_results(
            "flash_attn_backward",
            rows,
            [
                "dtype",
                "case",
                "method",
                "ms",
                "GFLOP/s",
                "vs best SDPA",
                "% of mm",
                "mm GFLOP/s",
                "peak extra MiB",
            ],
            [
                f"Causal, {NQ} query / {NKV} key heads, D = {D}: forward + backward of q, k, v. "
                "Dense: B = 1. Varlen: TND, heavy-tailed lengths, against one SDPA call per "
                "sequence.",
                "",
                "`.venv/bin/python benchmarks/bench_flash_attn_backward.py`",
            ],
            tier_baselines=True,
        )
    )


if __name__ == "__main__":
    main()
