"""Float64 reference implementations, written from the formulas in docs/, independent of the
kernels' tiling. Slow and simple on purpose."""

from __future__ import annotations

import torch


def sequence_bounds(batch, total_q, total_k, qlen, klen, layout):
    """Per sequence ``(q_begin, q_len, k_begin, k_len)`` in token coordinates of the inputs
    (BSND: within the batch entry; TND: within T)."""
    out = []
    for b in range(batch):
        if layout == "TND":
            q0 = 0 if b == 0 else int(qlen[b - 1])
            k0 = 0 if b == 0 else int(klen[b - 1])
            out.append((q0, int(qlen[b]) - q0, k0, int(klen[b]) - k0))
        else:
            s1 = total_q if qlen is None else int(qlen[b])
            s2 = total_k if klen is None else int(klen[b])
            out.append((0, s1, 0, s2))
    return out


def indexer_softmax_lse(
    q, k, w, *, actual_seq_qlen=None, actual_seq_klen=None, layout="BSND", sparse_mode=3
):
    """Reference for ``dense_lightning_indexer_softmax_lse``.

    ``I[g, i, j] = sum_{h in group g} w[i, h] * relu(q[i, h] . k[j, g])`` over visible ``j``;
    returns float64 ``(max_j I, sum_j exp(I - max))``, ``[B, N2, S1]`` (BSND) or ``[N2, T1]``
    (TND); rows with nothing visible get ``(-inf, 0)``.
    """
    q, k, w = q.double(), k.double(), w.double()
    if layout == "TND":
        q, k, w = q[None], k[None], w[None]
    n1, n2 = q.shape[2], k.shape[2]
    group = n1 // n2
    if layout == "TND":
        batch = len(actual_seq_qlen)
        out_max = torch.full((n2, q.shape[1]), float("-inf"), dtype=torch.float64)
    else:
        batch = q.shape[0]
        out_max = torch.full((batch, n2, q.shape[1]), float("-inf"), dtype=torch.float64)
    out_sum = torch.zeros_like(out_max)
    bounds = sequence_bounds(
        batch, q.shape[1], k.shape[1], actual_seq_qlen, actual_seq_klen, layout
    )
    for b, (q0, s1, k0, s2) in enumerate(bounds):
        bi = 0 if layout == "TND" else b
        qs = q[bi, q0 : q0 + s1]  # [s1, N1, D]
        ks = k[bi, k0 : k0 + s2]  # [s2, N2, D]
        ws = w[bi, q0 : q0 + s1]  # [s1, N1]
        for g in range(n2):
            heads = slice(g * group, (g + 1) * group)
            dots = torch.einsum("ihd,jd->ihj", qs[:, heads], ks[:, g])
            scores = torch.einsum("ih,ihj->ij", ws[:, heads], dots.clamp_min(0))
            i = torch.arange(s1)[:, None]
            j = torch.arange(s2)[None, :]
            visible = (j <= i + s2 - s1) if sparse_mode == 3 else torch.ones(s1, s2, dtype=bool)
            scores = scores.masked_fill(~visible, float("-inf"))
            m = scores.amax(dim=1) if s2 > 0 else torch.full((s1,), float("-inf"))
            safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            s = torch.exp(scores - safe[:, None]).sum(dim=1) if s2 > 0 else torch.zeros(s1)
            if layout == "TND":
                out_max[g, q0 : q0 + s1] = m
                out_sum[g, q0 : q0 + s1] = s
            else:
                out_max[b, g, :s1] = m
                out_sum[b, g, :s1] = s
    return out_max, out_sum
