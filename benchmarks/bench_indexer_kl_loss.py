"""dense_lightning_indexer_grad_kl_loss against the eager PyTorch composition it replaces
(materialised main and index scores, kl_div, torch autograd for the three gradients), in one
run: time, GFLOP/s and peak extra memory.

Causal, B = 1, main attention 16 query heads over 1 key head with D = 128 plus a 64-dim rope
part (MLA-like), indexer 8 query heads over 1 key head with D = 64. GFLOP/s count the fused
op's work: per visible (query, key) pair, two passes of the main scores (N1 x (D + Dr)) and the
index scores (N1i x Di), plus the products for d_query_index (two, in the first pass) and
d_key_index (one), each a multiply-add (2 flops).

    python benchmarks/bench_indexer_kl_loss.py [--seqs 2048 4096] [--dtypes bf16 fp32]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_extra_bytes, time_call, write_results  # noqa: E402

import opmesh  # noqa: E402

N1, N2, D, DR = 16, 1, 128, 64
N1I, N2I, DI = 8, 1, 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def inputs(seq, dtype):
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    t = dict(
        query=randn(1, seq, N1, D),
        key=randn(1, seq, N2, D),
        query_rope=randn(1, seq, N1, DR),
        key_rope=randn(1, seq, N2, DR),
        query_index=randn(1, seq, N1I, DI),
        key_index=randn(1, seq, N2I, DI),
        weights=randn(1, seq, N1I, scale=(N1I * DI) ** -0.5),
    )
    scale = (D + DR) ** -0.5
    q = torch.cat([t["query"], t["query_rope"]], -1).float()
    k = torch.cat([t["key"], t["key_rope"]], -1).float()
    # The main attention's statistics from flash_attn's log-sum-exp (sum = 1).
    _, lse = opmesh.flash_attn(
        q, k, k[..., :1].expand(-1, -1, -1, 16).contiguous(), softmax_scale=scale, mask_mode=3,
        return_softmax_lse=True,
    )  # fmt: skip
    t["softmax_max"] = lse.reshape(1, N2, N1 // N2, seq).transpose(2, 3).contiguous()
    t["softmax_sum"] = torch.ones_like(t["softmax_max"])
    m, s = opmesh.dense_lightning_indexer_softmax_lse(
        t["query_index"], t["key_index"], t["weights"]
    )
    t["softmax_max_index"], t["softmax_sum_index"] = m, s
    return t, scale


def fused(t, scale):
    return opmesh.dense_lightning_indexer_grad_kl_loss(
        t["query"], t["key"], t["query_index"], t["key_index"], t["weights"],
        t["softmax_max"], t["softmax_sum"], t["softmax_max_index"], t["softmax_sum_index"],
        scale, query_rope=t["query_rope"], key_rope=t["key_rope"],
    )  # fmt: skip


def eager(t, scale):
    """The composition a user writes: scores materialised, autograd for the gradients."""
    leaves = [t[n].detach().requires_grad_() for n in ("query_index", "key_index", "weights")]
    qi, ki, w = leaves
    seq = qi.shape[1]
    q = torch.cat([t["query"], t["query_rope"]], -1)
    k = torch.cat([t["key"], t["key_rope"]], -1)
    visible = torch.ones(seq, seq, dtype=torch.bool).tril()
    logits = torch.einsum("bshd,btd->bhst", q, k[:, :, 0]).float() * scale
    shift = (t["softmax_max"] + t["softmax_sum"].log()).reshape(1, seq, N1).transpose(1, 2)
    p = torch.exp(logits - shift[..., None]).masked_fill(~visible, 0.0).sum(1)
    target = p / p.sum(-1, keepdim=True)
    dots = torch.einsum("bshd,btd->bhst", qi, ki[:, :, 0]).float()
    scores = (dots.relu() * w.float().transpose(1, 2)[..., None]).sum(1)
    log_q = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), -1)
    loss = torch.nn.functional.kl_div(log_q.masked_fill(~visible, 0.0), target, reduction="sum")
    grads = torch.autograd.grad(loss, leaves)
    return (*grads, loss.reshape(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per method")
    args = parser.parse_args()
    rows = []
    for name in args.dtypes:
        for seq in args.seqs:
            t, scale = inputs(seq, DTYPES[name])
            ours, ref = fused(t, scale), eager(t, scale)
            errors = [
                float((a.float() - b.detach().float()).abs().max() / b.detach().float().abs().max())
                for a, b in zip(ours, ref, strict=True)
            ]
            pairs = seq * (seq + 1) // 2
            flops = 2 * pairs * (2 * N1 * (D + DR) + 2 * N1I * DI + 3 * N1I * DI)
            results = {}
            for method, fn in (("opmesh", fused), ("eager composition", eager)):
                results[method] = (
                    time_call(partial(fn, t, scale), min_repeats=2, budget_s=args.budget),
                    peak_extra_bytes(partial(fn, t, scale)),
                )
            base_t, base_m = results["eager composition"]
            for method, (sec, mem) in results.items():
                rows.append(
                    {
                        "dtype": name,
                        "S": seq,
                        "method": method,
                        "ms": f"{sec * 1e3:.0f}",
                        "GFLOP/s": f"{flops / sec / 1e9:.1f}",
                        "speed vs eager": f"{base_t / sec:.2f}x",
                        "peak extra MiB": f"{mem / 2**20:.1f}",
                        "memory vs eager": f"{100 * mem / base_m:.2f}%",
                        "max rel. error vs eager": (
                            f"{max(errors):.1e}" if method == "opmesh" else ""
                        ),
                    }
                )
            print(rows[-2:], flush=True)
    print(
        write_results(
            "indexer_kl_loss",
            rows,
            [
                "dtype",
                "S",
                "method",
                "ms",
                "GFLOP/s",
                "speed vs eager",
                "peak extra MiB",
                "memory vs eager",
                "max rel. error vs eager",
            ],  # fmt: skip
            [
                f"Causal, B = 1, main attention {N1} / {N2} heads, D = {D} + rope {DR}; indexer "
                f"{N1I} / {N2I} heads, D = {DI}. Loss and the three gradients.",
                "Peak extra memory: the rise of the process's resident size during one call "
                "(after a warm-up call). The fused op's scratch is O(tile) per thread and its "
                "outputs are the size of the indexer's inputs, so they fit in memory the process "
                "already holds and the rise rounds to 0.",
                "Errors: the largest difference of any output relative to that output's largest "
                "entry (the eager composition computes in float32 on the same inputs).",
                "",
                "`.venv/bin/python benchmarks/bench_indexer_kl_loss.py`",
            ],
        )
    )


if __name__ == "__main__":
    main()
