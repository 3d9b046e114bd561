"""One timing, in ms (median of 5 after a warm-up), of flash_attn's backward (causal, S = 2048,
32 query / 8 key heads, D = 128) or of the fused KL-loss op (bench_indexer_kl_loss.py's shape,
S = 2048), for comparing two builds run alternately:

    for py in /path/to/before/python .venv/bin/python; do
        $py benchmarks/time_backward_kl.py bwd fp32; done
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import opmesh

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["bwd", "kl"], help="backward or KL loss")
    parser.add_argument("dtype", choices=["fp32", "bf16"], help="input dtype")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.case == "bwd":
        g = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(1, 2048, n, 128, generator=g).to(dtype).requires_grad_() for n in (32, 8, 8)
        )
        out, _ = opmesh.flash_attn(q, k, v, mask_mode=3)
        dout = torch.randn_like(out)

        def run():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    else:
        import bench_indexer_kl_loss as kl

        t, scale = kl.inputs(2048, dtype)

        def run():
            kl.fused(t, scale)

    run()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(f"{statistics.median(times) * 1e3:.1f}")


if __name__ == "__main__":
    main()
