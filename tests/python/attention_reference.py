"""Float64 reference for flash_attn: gathers each sequence's rows from any layout (paged caches
through the block table), builds the visibility mask explicitly from its definition, and places
the results in the output layout. Shares no code with the kernel."""

from __future__ import annotations

import math

import torch


def _sequence_lengths(batch, q, k, layout_q, layout_kv, kw):
    """Per-sequence (q_start, q_len, k_start, k_len)."""
    cu_q, cu_k = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_kv")
    used_q, used_k = kw.get("seqused_q"), kw.get("seqused_kv")
    out = []
    for b in range(batch):
        if layout_q == "TND":
            qs, ql = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        else:
            qs, ql = 0, q.shape[1] if layout_q == "BSND" else q.shape[2]
        if layout_kv == "TND":
            ks, kl = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
        elif layout_kv == "PA_BBND":
            ks, kl = 0, int(used_k[b])
        else:
            ks, kl = 0, k.shape[1] if layout_kv == "BSND" else k.shape[2]
        if used_q is not None:
            ql = min(ql, int(used_q[b]))
        if used_k is not None:
            kl = min(kl, int(used_k[b]))
        out.append((qs, ql, ks, kl))
    return out


def _rows(x, layout, b, start, length):
    """[length, N, D] float64 rows of sequence b."""
    if layout == "TND":
        return x[start : start + length].double()
    if layout == "BNSD":
        return x[b, :, :length].transpose(0, 1).double()
    return x[b, :length].double()


def _paged_rows(cache, block_table, b, length):
    bs = cache.shape[1]
    idx = [(int(block_table[b, j // bs]), j % bs) for j in range(length)]
    if not idx:
        return cache.new_zeros((0,) + tuple(cache.shape[2:])).double()
    return torch.stack([cache[blk, off] for blk, off in idx]).double()


def visibility(s1, s2, mask_mode, win_left, win_right):
    """Boolean [s1, s2]: key j visible to query i (bottom-right aligned)."""
    i = torch.arange(s1).unsqueeze(1)
    j = torch.arange(s2).unsqueeze(0)
    diag = i + s2 - s1
    if mask_mode == 0:
        return torch.ones(s1, s2, dtype=torch.bool)
    if mask_mode == 3:
        return j <= diag
    lo = torch.ones_like(j <= diag) if win_left < 0 else j >= diag - win_left
    hi = torch.ones_like(lo) if win_right < 0 else j <= diag + win_right
    return lo & hi


def flash_attn_reference(q, k, v, **kw):
    """(``softcap`` and ``alibi_slopes`` as flash-attn: ``softcap * tanh(s / softcap)`` on the
    scaled scores, then ``- slope * |i + kl - ql - j|``.)"""
    layout_q = kw.get("layout_q", "BSND")
    layout_kv = kw.get("layout_kv", "BSND")
    layout_out = kw.get("layout_out", "BSND")
    mask_mode = kw.get("mask_mode", 0)
    win_left, win_right = kw.get("win_left", -1), kw.get("win_right", -1)
    sinks = kw.get("sinks")
    if layout_q == "TND":
        batch = kw["cu_seqlens_q"].numel() - 1
        nq, d = q.shape[1], q.shape[2]
    else:
        batch = q.shape[0]
        nq, d = (q.shape[2], q.shape[3]) if layout_q == "BSND" else (q.shape[1], q.shape[3])
    nkv = k.shape[1] if layout_kv in ("TND", "BNSD") else k.shape[2]
    dv = v.shape[-1]
    scale = kw.get("softmax_scale")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = nq // nkv if nkv else 0  # no heads: nothing to group
    if layout_q == "TND":
        out = torch.zeros(q.shape[0], nq, dv, dtype=torch.float64)
        lse = torch.full((nq, q.shape[0]), math.inf, dtype=torch.float64)
    else:
        s1 = q.shape[1] if layout_q == "BSND" else q.shape[2]
        out = torch.zeros(batch, s1, nq, dv, dtype=torch.float64)
        lse = torch.full((batch, nq, s1), math.inf, dtype=torch.float64)
    for b, (qs, ql, ks, kl) in enumerate(_sequence_lengths(batch, q, k, layout_q, layout_kv, kw)):
        if ql == 0:
            continue
        qb = _rows(q, layout_q, b, qs, ql)
        if layout_kv == "PA_BBND":
            kb = _paged_rows(k, kw["block_table"], b, kl)
            vb = _paged_rows(v, kw["block_table"], b, kl)
        else:
            kb, vb = _rows(k, layout_kv, b, ks, kl), _rows(v, layout_kv, b, ks, kl)
        kb = kb.repeat_interleave(group, dim=1)  # [kl, nq, d]
        vb = vb.repeat_interleave(group, dim=1)
        scores = scale * torch.einsum("ind,jnd->nij", qb, kb)  # [nq, ql, kl]
        softcap = kw.get("softcap", 0.0)
        if softcap > 0:  # flash-attn's soft-capping of the scaled scores
            scores = softcap * torch.tanh(scores / softcap)
        slopes = kw.get("alibi_slopes")
        if slopes is not None:  # ALiBi: -slope * |i + kl - ql - j|
            slope = (slopes[b] if slopes.dim() == 2 else slopes).double().view(nq, 1, 1)
            i = torch.arange(ql, dtype=torch.float64).view(1, ql, 1)
            j = torch.arange(kl, dtype=torch.float64).view(1, 1, kl)
            scores = scores - slope * (i + kl - ql - j).abs()
        visible = visibility(ql, kl, mask_mode, win_left, win_right)
        scores = scores.masked_fill(~visible, -math.inf)
        if sinks is not None:
            sink = sinks.double().view(nq, 1, 1).expand(nq, ql, 1)
            scores = torch.cat([scores, sink], dim=2)
            vb = torch.cat([vb, torch.zeros(1, nq, dv, dtype=torch.float64)], dim=0)
        row_lse = torch.logsumexp(scores, dim=2)  # -inf where nothing is visible
        probs = torch.exp(scores - row_lse.unsqueeze(2)).nan_to_num(0.0)
        if torch.isfinite(vb).all():
            ob = torch.einsum("nij,jne->ine", probs, vb)  # [ql, nq, dv]
        else:
            # A key a row does not see contributes nothing, even an infinite or NaN value
            # (0 * inf would make NaN): only visible terms enter the sum.
            terms = probs.unsqueeze(-1) * vb.permute(1, 0, 2).unsqueeze(1)  # [nq, ql, kl, dv]
            seen = visible
            if sinks is not None:
                seen = torch.cat([seen, torch.ones(ql, 1, dtype=torch.bool)], dim=1)
            terms = torch.where(seen.view(1, ql, -1, 1), terms, 0.0)
            ob = terms.sum(2).permute(1, 0, 2)
        row_lse = torch.where(torch.isneginf(row_lse), math.inf, row_lse)
        if layout_q == "TND":
            out[qs : qs + ql] = ob
            lse[:, qs : qs + ql] = row_lse
        else:
            out[b, :ql] = ob
            lse[b, :, :ql] = row_lse
    if layout_out == "BNSD":
        out = out.transpose(1, 2)
    return out, lse
