"""flash_attn forward + backward against scaled_dot_product_attention's forward + backward (the
CPU flash kernels of PyTorch, with enable_gqa and with repeated key/value heads), in one run.

Causal, B = 1, S in {1024, 2048}, 32 query / 8 key heads, D = 128. A training step's attention:
the forward, then the gradients of q, k and v for a random output gradient. GFLOP/s count the
forward's 4 * D and the backward's 10 * D flops per visible query-key pair and head (the
backward recomputes the scores: five products of the forward's size), so ratios are time
ratios.

    python benchmarks/bench_flash_attn_backward.py [--seqs 1024 2048] [--dtypes bf16 fp32]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_call, write_results  # noqa: E402

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per method")
    args = parser.parse_args()
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        for seq in args.seqs:
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
            flops = 14 * NQ * D * seq * (seq + 1) // 2
            times = {
                "opmesh": time_call(partial(step_opmesh, q, k, v, dout), budget_s=args.budget),
                "sdpa (enable_gqa)": time_call(
                    partial(step_sdpa, q, k, v, dout, False), budget_s=args.budget
                ),
                "sdpa (repeated kv)": time_call(
                    partial(step_sdpa, q, k, v, dout, True), budget_s=args.budget
                ),
            }
            best = min(t for m, t in times.items() if m != "opmesh")
            for method, t in times.items():
                rows.append(
                    {
                        "dtype": name,
                        "S": seq,
                        "method": method,
                        "ms": f"{t * 1e3:.1f}",
                        "GFLOP/s": f"{flops / t / 1e9:.1f}",
                        "vs best SDPA": f"{best / t:.2f}x",
                        "max |grad - sdpa grad|": f"{err:.1e}" if method == "opmesh" else "",
                    }
                )
            print(rows[-3:], flush=True)
    print(
        write_results(
            "flash_attn_backward",
            rows,
            ["dtype", "S", "method", "ms", "GFLOP/s", "vs best SDPA", "max |grad - sdpa grad|"],
            [
                f"Causal, B = 1, {NQ} query / {NKV} key heads, D = {D}: forward + backward of "
                "q, k, v.",
                "",
                "`.venv/bin/python benchmarks/bench_flash_attn_backward.py`",
            ],
        )
    )


if __name__ == "__main__":
    main()
