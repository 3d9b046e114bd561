"""The sparse stage of DeepSeek sparse attention against the strongest PyTorch alternative.

Parts (``--parts``):

- ``indexer``: ``lightning_indexer`` (top-K keys per token) against a chunked PyTorch composition
  (matmul, relu, weighted head sum, causal mask, ``topk``), eager and compiled, at the chunk size
  that runs fastest; time, GFLOP/s (visible score entries x 2 N1 D) and peak extra memory.
- ``attention``: ``sparse_flash_attention`` over the indexer's top-K (forward, and forward +
  backward) against opmesh's dense causal ``flash_attn`` on the same q/k/v and against a
  gather + batched-matmul composition (chunked over query rows, eager).
- ``kl``: ``sparse_lightning_indexer_grad_kl_loss`` (the loss and the indexer's three
  gradients) over the indexer's top-K, with the sparse attention's statistics, against the
  same loss by eager PyTorch autograd on gathered keys (chunked over query rows).
- ``long``: one DSA layer at long context (``--long-seq``, default 131072, top-``--long-topk``
  2048): the indexer's top-K, sparse attention, and the sparse KL loss, forward and backward,
  one call each (time per phase, peak extra memory), with the FLOPs of the dense layer it
  replaces beside it. Not timed against an alternative: the dense layer at this length is
  out of reach of this machine.
- ``decode``: one query token per sequence over paged caches (``PA_BSND``): ``lightning_indexer``
  against the same composition on the gathered keys, and a DSA decode step (indexer top-K, then
  ``sparse_flash_attention``) against dense paged ``flash_attn`` over the whole context.

    python benchmarks/bench_dsa.py [--seq 8192] [--topk 512] [--parts indexer decode]
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
    interleaved,
    peak_extra_bytes,
    tier_compositions,
    time_call,
    write_results,
)

import opmesh  # noqa: E402


def indexer_composition(q, k, w, topk, chunk):
    """Top-K of the indexer score per query row, ``chunk`` query rows at a time (one sequence,
    BSND with B = 1, N2 = 1, causal): the scores of a chunk are ``[chunk, S2]``."""
    s1, s2 = q.shape[1], k.shape[1]
    keys = k[0, :, 0]  # [S2, D]
    out = torch.empty(s1, topk, dtype=torch.int64)
    for c0 in range(0, s1, chunk):
        rows = q[0, c0 : c0 + chunk]  # [c, N1, D]
        dots = torch.matmul(rows, keys.T).relu_()  # [c, N1, S2]
        scores = torch.matmul(w[0, c0 : c0 + chunk, None, :].to(dots.dtype), dots)[:, 0]
        i = torch.arange(c0, c0 + rows.shape[0])[:, None]
        scores = scores.float().masked_fill(torch.arange(s2)[None, :] > i + s2 - s1, float("-inf"))
        out[c0 : c0 + chunk] = scores.topk(topk, dim=-1).indices
    return out


def bench_indexer(args, rows):
    s, n1, d, topk = args.seq, args.heads, args.dim, args.topk
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, n1, d, generator=g).to(torch.bfloat16)
    k = torch.randn(1, s, 1, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(1, s, n1, generator=g) * (n1 * d) ** -0.5).to(torch.bfloat16)
    visible = s * (s + 1) / 2
    flops = visible * 2 * n1 * d
    compiled = torch.compile(indexer_composition, dynamic=False)
    methods = {"opmesh": partial(opmesh.lightning_indexer, q, k, w, sparse_count=topk)}
    for chunk in args.chunks:
        methods |= tier_compositions(
            f"eager chunk {chunk}", indexer_composition, q, k, w, topk, chunk
        )
        methods |= tier_compositions(f"compiled chunk {chunk}", compiled, q, k, w, topk, chunk)
    # Agreement: the share of the composition's top-K (visible entries) that opmesh also selects
    # (near ties in bf16-rounded scores may swap the last entries).
    ours = methods["opmesh"]()[0][0, :, 0].long()
    theirs = indexer_composition(q, k, w, topk, args.chunks[0])
    valid = theirs <= torch.arange(s)[:, None]
    picked = torch.zeros(s, s + 1, dtype=torch.bool)
    picked.scatter_(1, ours.masked_fill(ours < 0, s), True)
    agree = (torch.gather(picked, 1, theirs) & valid).sum() / valid.sum()
    timed = {}
    for method, fn in methods.items():
        seconds = time_call(fn, budget_s=args.budget)
        timed[method] = (seconds, peak_extra_bytes(fn))
        print(method, f"{seconds * 1e3:.1f} ms", flush=True)
    best = best_on_this_tier({m: t for m, (t, _) in timed.items()}, ["opmesh"])
    for method, (seconds, memory) in timed.items():
        rows.append(
            {
                "part": "indexer",
                "shape": f"S={s} N1={n1} D={d} K={topk}",
                "method": method,
                "ms": f"{seconds * 1e3:.1f}",
                "GFLOP/s": f"{flops / seconds / 1e9:.1f}",
                "peak extra MiB": f"{memory / 2**20:.1f}",
                "opmesh speed-up": f"{seconds / timed['opmesh'][0]:.2f}x",
                "note": (
                    f"memory {timed['opmesh'][1] / max(timed[best][1], 1):.1%} of the best "
                    f"({best}); same rows as the composition: {agree:.2%}"
                    if method == "opmesh"
                    else "best composition on this tier"
                    if method == best
                    else ""
                ),
            }
        )


def bench_decode(args, rows):
    batch, context, n1, d, topk, block = 4, args.context, args.heads, args.dim, args.decode_topk, 64
    g = torch.Generator().manual_seed(1)
    blocks_per_seq = context // block
    cache = torch.randn(batch * blocks_per_seq, block, 1, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(batch * blocks_per_seq, generator=g).view(batch, blocks_per_seq)
    table = table.to(torch.int32)
    q = torch.randn(batch, 1, n1, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(batch, 1, n1, generator=g) * (n1 * d) ** -0.5).to(torch.bfloat16)
    lengths = torch.full((batch,), context, dtype=torch.int32)

    def ours():
        return opmesh.lightning_indexer(
            q, cache, w, block_table=table, actual_seq_lengths_key=lengths,
            layout_key="PA_BSND", sparse_count=topk,
        )  # fmt: skip

    def composition(q, cache, w):
        keys = cache[table.long()].flatten(1, 2)  # [B, context, 1, D]
        return [indexer_composition(q[b : b + 1], keys[b : b + 1], w[b : b + 1], topk, 1)
                for b in range(batch)]  # fmt: skip

    # One decode step of a DSA layer against dense paged attention over the whole context: the
    # indexer's top-K on its cache, then MLA-style main attention (absorbed: one latent cache of
    # 512 dims as key and value, a 64-dim rope part, N2 = 1) over those keys only.
    hm, dl, dr = args.mla_heads, 512, 64
    latent = torch.randn(batch * blocks_per_seq, block, 1, dl, generator=g).to(torch.bfloat16)
    rope = torch.randn(batch * blocks_per_seq, block, 1, dr, generator=g).to(torch.bfloat16)
    qm = torch.randn(batch, 1, hm, dl, generator=g).to(torch.bfloat16)
    qr = torch.randn(batch, 1, hm, dr, generator=g).to(torch.bfloat16)
    scale = (dl + dr) ** -0.5
    k_dense = torch.cat([latent, rope], dim=-1)  # the dense kernel's keys: latent | rope
    q_dense = torch.cat([qm, qr], dim=-1)

    def sparse_step():
        top = ours()[0]
        return opmesh.sparse_flash_attention(
            qm, latent, latent, top, scale, block_table=table, actual_seq_lengths_kv=lengths,
            query_rope=qr, key_rope=rope, layout_kv="PA_BSND", attention_mode=2,
        )[0]  # fmt: skip

    def dense_step():
        return opmesh.flash_attn(
            q_dense, k_dense, latent, block_table=table, seqused_kv=lengths, layout_kv="PA_BBND",
            mask_mode=3, softmax_scale=scale,
        )[0]  # fmt: skip

    indexer_flops = batch * context * 2 * n1 * d
    compositions = tier_compositions(
        "indexer: eager gather + composition", composition, q, cache, w
    )
    parts = {
        "indexer: opmesh": (ours, indexer_flops),
        **{method: (fn, indexer_flops) for method, fn in compositions.items()},
        "step: indexer + sparse attention": (sparse_step, None),
        "step: dense paged flash_attn": (dense_step, batch * context * 2 * hm * (2 * dl + dr)),
    }
    timed = {m: time_call(fn, budget_s=args.budget) for m, (fn, _) in parts.items()}
    for method, (_, flops) in parts.items():
        seconds = timed[method]
        base = (
            "indexer: opmesh"
            if method.startswith("indexer")
            else "step: indexer + sparse attention"
        )
        rows.append(
            {
                "part": "decode (PA_BSND)",
                "shape": f"B={batch} context={context} indexer N1={n1} D={d}, MLA N1={hm} "
                f"D={dl}+{dr}, K={topk}",
                "method": method,
                "ms": f"{seconds * 1e3:.2f}",
                "GFLOP/s": f"{flops / seconds / 1e9:.1f}" if flops else "",
                "opmesh speed-up": f"{seconds / timed[base]:.2f}x",
                "note": f"{batch / seconds:.0f} tokens/s",
            }
        )


def gather_composition(q, k, v, idx, scale, chunk=256):
    """Sparse attention by gathering each row's selected keys and values (B = 1, N2 = 1, causal):
    ``[chunk, K, D]`` gathers, two batched matmuls and a masked softmax per chunk."""
    s1 = q.shape[1]
    keys, values = k[0, :, 0], v[0, :, 0]  # [S2, D]
    out = torch.empty_like(q[0])
    for c0 in range(0, s1, chunk):
        sel = idx[0, c0 : c0 + chunk, 0].long()  # [c, K]
        valid = (sel >= 0) & (sel <= torch.arange(c0, c0 + sel.shape[0])[:, None])
        safe = sel.clamp(min=0)
        kg, vg = keys[safe], values[safe]  # [c, K, D]
        scores = torch.bmm(q[0, c0 : c0 + chunk], kg.transpose(1, 2)).float() * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        out[c0 : c0 + chunk] = torch.bmm(scores.softmax(-1).to(vg.dtype), vg)
    return out[None]


def bench_attention(args, rows):
    s, n1, d, topk = args.seq, args.attn_heads, args.attn_dim, args.topk
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, s, n1, d, generator=g).to(torch.bfloat16)
    k = torch.randn(1, s, 1, d, generator=g).to(torch.bfloat16)
    v = torch.randn(1, s, 1, d, generator=g).to(torch.bfloat16)
    qi = torch.randn(1, s, args.heads, args.dim, generator=g).to(torch.bfloat16)
    ki = torch.randn(1, s, 1, args.dim, generator=g).to(torch.bfloat16)
    wi = (torch.randn(1, s, args.heads, generator=g) * (args.heads * args.dim) ** -0.5).bfloat16()
    idx = opmesh.lightning_indexer(qi, ki, wi, sparse_count=topk)[0]
    scale = d**-0.5
    selected = (idx >= 0).sum().item()
    sparse_flops = selected * n1 * 4 * d  # QK and PV per selected key and head
    dense_flops = s * (s + 1) / 2 * n1 * 4 * d

    def sparse():
        return opmesh.sparse_flash_attention(q, k, v, idx, scale)[0]

    def dense():
        return opmesh.flash_attn(q, k, v, mask_mode=3, softmax_scale=scale)[0]

    def training(fn):
        def step():
            qq = q.detach().requires_grad_(True)
            kk = k.detach().requires_grad_(True)
            vv = v.detach().requires_grad_(True)
            out = fn(qq, kk, vv)
            out.backward(torch.ones_like(out))

        return step

    methods = {
        "forward: opmesh sparse": (sparse, sparse_flops),
        "forward: opmesh dense flash_attn": (dense, dense_flops),
        **{
            method: (fn, sparse_flops)
            for method, fn in tier_compositions(
                "forward: gather + bmm", gather_composition, q, k, v, idx, scale
            ).items()
        },
        "fwd+bwd: opmesh sparse": (
            training(lambda a, b, c: opmesh.sparse_flash_attention(a, b, c, idx, scale)[0]),
            3.5 * sparse_flops,
        ),
        "fwd+bwd: opmesh dense flash_attn": (
            training(
                lambda a, b, c: opmesh.flash_attn(a, b, c, mask_mode=3, softmax_scale=scale)[0]
            ),
            3.5 * dense_flops,
        ),
    }
    # Timed in turn, three rounds (common.interleaved): the machine's drift stays out of the ratios.
    medians = interleaved([fn for fn, _ in methods.values()], budget_s=args.budget, min_repeats=1)
    timed = dict(zip(methods, medians, strict=True))
    best = best_on_this_tier({m: t for m, t in timed.items() if "gather" in m}, [])
    for method, (_, flops) in methods.items():
        seconds = timed[method]
        base = (
            "fwd+bwd: opmesh sparse" if method.startswith("fwd+bwd") else "forward: opmesh sparse"
        )
        rows.append(
            {
                "part": "attention",
                "shape": f"S={s} N1={n1} N2=1 D={d} K={topk}",
                "method": method,
                "ms": f"{seconds * 1e3:.1f}",
                "GFLOP/s": f"{flops / seconds / 1e9:.1f}",
                "opmesh speed-up": f"{seconds / timed[base]:.2f}x",
                "note": "FLOPs of the selected keys"
                + ("; best composition on this tier" if method == best else "")
                if "sparse" in method or "gather" in method
                else f"{dense_flops / sparse_flops:.1f}x the sparse FLOPs",
            }
        )
        print(rows[-1], flush=True)


def sparse_kl_composition(q, k, qi, ki, w, idx, lse, scale, chunk):
    """The sparse KL loss and its gradients by eager autograd (B = 1, N2 = N2index = 1, causal),
    ``chunk`` query rows at a time: gathered keys ``[chunk, K, D]``, batched matmuls in the
    inputs' dtype, softmax and logs in float32. ``lse``: the main attention's ``[S1, N1]``."""
    s1 = q.shape[1]
    keys = k[0, :, 0]
    leaves = [x.detach().requires_grad_(True) for x in (qi[0], ki[0, :, 0], w[0])]
    qi_l, ki_l, w_l = leaves
    total = torch.zeros((), dtype=torch.float64)
    for c0 in range(0, s1, chunk):
        sel = idx[0, c0 : c0 + chunk, 0].long()  # [c, K]
        valid = (sel >= 0) & (sel <= torch.arange(c0, c0 + sel.shape[0])[:, None])
        safe = sel.clamp(min=0)
        with torch.no_grad():
            s = torch.bmm(q[0, c0 : c0 + chunk], keys[safe].transpose(1, 2)).float() * scale
            p = torch.exp(s - lse[c0 : c0 + chunk, :, None]).sum(1).masked_fill(~valid, 0.0)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        dots = torch.bmm(qi_l[c0 : c0 + chunk], ki_l[safe].transpose(1, 2)).relu()  # [c, H, K]
        score = torch.bmm(w_l[c0 : c0 + chunk, None, :].to(dots.dtype), dots)[:, 0].float()
        log_q = score.masked_fill(~valid, float("-inf")).log_softmax(-1).masked_fill(~valid, 0.0)
        loss = (torch.xlogy(p, p) - p * log_q).sum()
        loss.backward()
        total += loss.detach().double()
    return total, qi_l.grad, ki_l.grad, w_l.grad


def bench_kl(args, rows):
    s, n1, d, topk = args.seq, args.attn_heads, args.attn_dim, args.topk
    n1i, di = args.heads, args.dim
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, s, n1, d, generator=g).to(torch.bfloat16)
    k = torch.randn(1, s, 1, d, generator=g).to(torch.bfloat16)
    qi = torch.randn(1, s, n1i, di, generator=g).to(torch.bfloat16)
    ki = torch.randn(1, s, 1, di, generator=g).to(torch.bfloat16)
    wi = (torch.randn(1, s, n1i, generator=g) * (n1i * di) ** -0.5).bfloat16()
    idx = opmesh.lightning_indexer(qi, ki, wi, sparse_count=topk)[0]
    scale = d**-0.5
    _, smax, ssum = opmesh.sparse_flash_attention(q, k, k, idx, scale, return_softmax_lse=True)
    lse = (smax + ssum.log())[0, 0]  # [S1, N1]
    selected = (idx >= 0).sum().item()
    # Per selected key: the main scores (2 N1 D), and for the indexer its scores, d_query_index
    # and d_key_index (3 x 2 N1index Dindex).
    flops = selected * (2 * n1 * d + 3 * 2 * n1i * di)

    def fused():
        return opmesh.sparse_lightning_indexer_grad_kl_loss(
            q, k, qi, ki, wi, idx, smax, ssum, scale
        )

    want = float(fused()[3])
    methods = {"opmesh fused": fused}
    for chunk in args.chunks:
        methods |= tier_compositions(
            f"eager autograd chunk {chunk}",
            sparse_kl_composition, q, k, qi, ki, wi, idx, lse, scale, chunk,
        )  # fmt: skip
    for method, fn in methods.items():
        got = float(fn()[3 if method == "opmesh fused" else 0])
        assert abs(got - want) <= 1e-2 * abs(want), (method, got, want)  # the same loss
    medians = interleaved(list(methods.values()), budget_s=args.budget, min_repeats=1)
    timed = dict(zip(methods, medians, strict=True))
    best = best_on_this_tier(timed, ["opmesh fused"])
    memory = {m: peak_extra_bytes(fn) for m, fn in methods.items()}
    for method in methods:
        seconds = timed[method]
        rows.append(
            {
                "part": "kl",
                "shape": f"S={s} N1={n1} D={d} indexer N1={n1i} D={di} K={topk}",
                "method": method,
                "ms": f"{seconds * 1e3:.1f}",
                "GFLOP/s": f"{flops / seconds / 1e9:.1f}",
                "peak extra MiB": f"{memory[method] / 2**20:.0f}",
                "opmesh speed-up": f"{seconds / timed['opmesh fused']:.2f}x",
                "note": "loss + 3 gradients"
                + ("; best composition on this tier" if method == best else ""),
            }
        )
        print(rows[-1], flush=True)


def bench_long(args, rows):
    """One call of each phase: at this length a repeat costs minutes."""
    import time

    s, topk = args.long_seq, args.long_topk
    n1, d, n1i, di = 8, 64, 4, 64
    g = torch.Generator().manual_seed(4)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    q, k, v = randn(1, s, n1, d), randn(1, s, 1, d), randn(1, s, 1, d)
    qi, ki = randn(1, s, n1i, di), randn(1, s, 1, di)
    wi = randn(1, s, n1i, scale=(n1i * di) ** -0.5)
    scale = d**-0.5
    leaves = [x.requires_grad_(True) for x in (q, k, v, qi, ki, wi)]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    from common import _status_kib

    before = _status_kib("VmRSS")
    clock = {}
    t = time.perf_counter()
    top, _ = opmesh.lightning_indexer(qi, ki, wi, sparse_count=topk)
    clock["indexer top-K"] = time.perf_counter() - t
    t = time.perf_counter()
    out, smax, ssum = opmesh.sparse_flash_attention(q, k, v, top, scale, return_softmax_lse=True)
    clock["sparse attention forward"] = time.perf_counter() - t
    t = time.perf_counter()
    kl = opmesh.sparse_indexer_kl_loss(qi, ki, wi, q.detach(), k.detach(), top, smax, ssum, scale)
    clock["sparse KL loss (with its gradients)"] = time.perf_counter() - t
    t = time.perf_counter()
    (out.float().square().mean() + kl.sum() / s).backward()
    clock["backward (sparse attention; KL scaling)"] = time.perf_counter() - t
    peak = _status_kib("VmHWM") - before
    assert all(x.grad is not None for x in leaves)
    selected = (top >= 0).sum().item()
    visible = s * (s + 1) / 2
    sparse = {
        "indexer top-K": visible * 2 * n1i * di,
        "sparse attention forward": selected * 4 * n1 * d,
        "sparse KL loss (with its gradients)": selected * (2 * n1 * d + 4 * 2 * n1i * di),
        "backward (sparse attention; KL scaling)": selected * 10 * n1 * d,
    }
    dense_flops = visible * (4 * n1 * d * 3.5 + 2 * n1i * di + 2 * n1 * d + 4 * 2 * n1i * di)
    shape = f"S={s} N1={n1} D={d} indexer N1={n1i} D={di} K={topk}"
    for phase, seconds in clock.items():
        rows.append(
            {
                "part": "long",
                "shape": shape,
                "method": phase,
                "ms": f"{seconds * 1e3:.0f}",
                "GFLOP/s": f"{sparse[phase] / seconds / 1e9:.1f}",
            }
        )
        print(rows[-1], flush=True)
    total = sum(clock.values())
    rows.append(
        {
            "part": "long",
            "shape": shape,
            "method": "DSA layer forward + backward",
            "ms": f"{total * 1e3:.0f}",
            "GFLOP/s": f"{sum(sparse.values()) / total / 1e9:.1f}",
            "peak extra MiB": f"{peak / 1024:.0f}",
            "note": f"{sum(sparse.values()) / 1e12:.1f} TFLOP; the dense layer (attention "
            f"forward + backward, dense KL loss): {dense_flops / 1e12:.0f} TFLOP",
        }
    )
    print(rows[-1], flush=True)


PARTS = {
    "long": bench_long,
    "indexer": bench_indexer,
    "attention": bench_attention,
    "kl": bench_kl,
    "decode": bench_decode,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--seq", type=int, default=8192, help="prefill sequence length")
    parser.add_argument("--topk", type=int, default=512, help="K for prefill")
    parser.add_argument("--context", type=int, default=32768, help="decode context length")
    parser.add_argument("--decode-topk", type=int, default=2048, help="K for decode")
    parser.add_argument("--heads", type=int, default=64, help="indexer query heads N1")
    parser.add_argument("--dim", type=int, default=128, help="indexer head dim D")
    parser.add_argument("--attn-heads", type=int, default=16, help="main attention heads N1")
    parser.add_argument("--attn-dim", type=int, default=128, help="main attention head dim")
    parser.add_argument("--mla-heads", type=int, default=128, help="decode: MLA query heads")
    parser.add_argument("--long-seq", type=int, default=131072, help="long: sequence length")
    parser.add_argument("--long-topk", type=int, default=2048, help="long: K")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per method")
    args = parser.parse_args()
    rows = []
    for part in args.parts:
        PARTS[part](args, rows)
    columns = [
        "part",
        "shape",
        "method",
        "ms",
        "GFLOP/s",
        "peak extra MiB",
        "opmesh speed-up",
        "note",
    ]
    text = write_results(
        "dsa",
        rows,
        columns,
        notes=[
            "bf16 inputs, causal (sparse_mode=3), one sequence for prefill, N2 = 1.",
            "'opmesh speed-up': this row's time over opmesh's (above 1: opmesh is faster).",
            "Peak extra memory: resident-set high-water mark during one call minus before it.",
            "Best composition on this tier: the fastest PyTorch composition a machine of this "
            "run's tier runs (bf16 as torch runs it there, or on inputs made float32 where the "
            "tier has no bf16 products).",
        ],
        tier_baselines=True,
    )
    print(text)


if __name__ == "__main__":
    main()
