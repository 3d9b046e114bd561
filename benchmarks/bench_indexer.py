"""dense_lightning_indexer_softmax_lse vs the PyTorch composition, eager and compiled.

The composition is what a user would write: einsum -> relu -> weighted head sum -> causal mask ->
max / sum of exp. It materialises the [S1, N1, S2] product; ours streams tiles. GFLOP/s counts
only visible score entries (2 * N1 * D per entry) for every method, so the ratios are time ratios.

    python benchmarks/bench_indexer.py [--sizes 1024 4096] [--dtypes bf16 fp32]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    best_on_this_tier,
    peak_extra_bytes,
    tier_compositions,
    time_call,
    write_results,
)

import opmesh  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def composition(q, k, w):
    """Eager PyTorch: BSND inputs, causal bottom-right, same outputs as the op."""
    b, s1, n1, d = q.shape
    s2, n2 = k.shape[1], k.shape[2]
    g = n1 // n2
    dots = torch.einsum("bsngd,btnd->bnsgt", q.view(b, s1, n2, g, d), k)
    scores = torch.einsum("bnsgt,bsng->bnst", dots.relu_(), w.view(b, s1, n2, g).to(dots.dtype))
    scores = scores.float()
    i = torch.arange(s1)[:, None]
    j = torch.arange(s2)[None, :]
    scores = scores.masked_fill(j > i + s2 - s1, float("-inf"))
    m = scores.amax(-1)
    return m, torch.exp(scores - m[..., None]).sum(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per method")
    args = parser.parse_args()

    compiled = torch.compile(composition, dynamic=False)
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        for s in args.sizes:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, s, args.heads, args.dim, generator=g).to(dtype)
            k = torch.randn(1, s, 1, args.dim, generator=g).to(dtype)
            w = (torch.randn(1, s, args.heads, generator=g) * (args.heads * args.dim) ** -0.5).to(
                dtype
            )
            flops = s * (s + 1) / 2 * 2 * args.heads * args.dim
            methods = {"opmesh": partial(opmesh.dense_lightning_indexer_softmax_lse, q, k, w)}
            methods |= tier_compositions("eager", composition, q, k, w)
            methods |= tier_compositions("compiled", compiled, q, k, w)
            ours = methods["opmesh"]()
            ref = composition(q.double(), k.double(), w.double())
            err = (ours[0].double() - ref[0]).abs().max().item()
            result = {}
            for method, fn in methods.items():
                seconds = time_call(fn, budget_s=args.budget)
                memory = peak_extra_bytes(fn)
                result[method] = seconds
                rows.append(
                    {
                        "dtype": name,
                        "S": s,
                        "method": method,
                        "ms": f"{seconds * 1e3:.1f}",
                        "GFLOP/s": f"{flops / seconds / 1e9:.1f}",
                        "peak extra MiB": f"{memory / 2**20:.2f}",
                        "_seconds": seconds,
                        "_bytes": memory,
                    }
                )
                print(rows[-1], flush=True)
            best = result[best_on_this_tier(result, ["opmesh"])]
            group = rows[-len(methods) :]
            for row in group:
                row["vs eager"] = f"{result['eager'] / row['_seconds']:.2f}x"
                row["vs compiled"] = f"{result['compiled'] / row['_seconds']:.2f}x"
                row["vs best on tier"] = f"{best / row['_seconds']:.2f}x"
                row["max err vs fp64"] = f"{err:.1e}" if row["method"] == "opmesh" else ""
            eager_mem = next(r["_bytes"] for r in group if r["method"] == "eager")
            group[0]["mem / eager"] = f"{group[0]['_bytes'] / max(eager_mem, 1):.4%}"
    columns = [
        "dtype",
        "S",
        "method",
        "ms",
        "GFLOP/s",
        "peak extra MiB",
        "mem / eager",
        "vs eager",
        "vs compiled",
        "vs best on tier",
        "max err vs fp64",
    ]
    text = write_results(
        "indexer",
        rows,
        columns,
        tier_baselines=True,
        notes=[
            f"B=1, S1=S2=S, N1={args.heads}, N2=1, D={args.dim}, causal (sparse_mode=3).",
            "'vs eager' / 'vs compiled': that method's time over this row's (higher is faster); "
            "'vs best on tier': the fastest composition a machine of this run's tier runs (bf16 "
            "as torch runs it there, or on inputs made float32 where the tier has no bf16 "
            "products) over this row's.",
            "Peak extra memory: resident-set high-water mark during one call minus before it, in a"
            " warm process. opmesh needs about 1.1 MiB of scratch per worker (N1=64, D=128), reused"
            " from the allocator's free lists after the first call, so it rounds to 0 here.",
        ],
    )
    print(text)


if __name__ == "__main__":
    main()
