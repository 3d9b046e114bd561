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


UNBOUNDED = 2**63 - 1


def indexer_visible(
    s1, s2, sparse_mode, pre_tokens=UNBOUNDED, next_tokens=UNBOUNDED, cmp_ratio=1, residual=0
):
    """``[s1, s2]`` bool: key ``j`` visible to query ``i`` with diagonal ``d = i + s2 - s1``:
    ``d - pre_tokens <= j <= d + next_tokens``, and ``j <= d`` when ``sparse_mode == 3``."""
    if cmp_ratio > 1 and sparse_mode == 3:
        return compressed_visible(s1, s2, cmp_ratio, residual)
    i = torch.arange(s1)[:, None]
    j = torch.arange(s2)[None, :]
    d = i + s2 - s1
    visible = (j >= d - min(pre_tokens, 2**40)) & (j <= d + min(next_tokens, 2**40))
    if sparse_mode == 3:
        visible &= j <= d
    return visible


def indexer_softmax_lse(
    q,
    k,
    w,
    *,
    actual_seq_qlen=None,
    actual_seq_klen=None,
    layout="BSND",
    sparse_mode=3,
    pre_tokens=UNBOUNDED,
    next_tokens=UNBOUNDED,
    cmp_ratio=1,
    cmp_residual_key=None,
):
    """Reference for ``dense_lightning_indexer_softmax_lse`` (compressed keys: ``cmp_ratio``
    and per-sequence ``cmp_residual_key``, see ``compressed_visible``).

    ``I[g, i, j] = sum_{h in group g} w[i, h] * relu(q[i, h] . k[j, g])`` over visible ``j``;
    returns float64 ``(max_j I, sum_j exp(I - max))``, ``[B, N2, S1]`` (BSND) or ``[N2, T1]``
    (TND); rows with nothing visible get ``(-inf, 0)``.
    """
    q, k, w = q.double(), k.double(), w.double()
    if layout == "TND":
        q, k, w = q[None], k[None], w[None]
    n1, n2 = q.shape[2], k.shape[2]
    group = n1 // n2 if n2 else 0  # no heads: nothing to group
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
            residual = int(cmp_residual_key[b]) if cmp_residual_key is not None else 0
            visible = indexer_visible(
                s1, s2, sparse_mode, pre_tokens, next_tokens, cmp_ratio, residual
            )
            scores = scores.masked_fill(~visible, float("-inf"))
            m = scores.amax(dim=1) if s2 > 0 else torch.full((s1,), float("-inf"))
            m = torch.where(visible.any(dim=1), m, torch.full_like(m, float("-inf")))
            safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            s = torch.exp(scores - safe[:, None]).sum(dim=1) if s2 > 0 else torch.zeros(s1)
            if layout == "TND":
                out_max[g, q0 : q0 + s1] = m
                out_sum[g, q0 : q0 + s1] = s
            else:
                out_max[b, g, :s1] = m
                out_sum[b, g, :s1] = s
    return out_max, out_sum


def main_attention_stats(query, key, scale, *, query_rope=None, key_rope=None, visible):
    """float64 ``(max, sum)`` of the main attention's scaled logits over the visible keys of one
    sequence: query ``[s1, N1, D]``, key ``[s2, N2, D]``; returns ``[N2, s1, G]`` each."""
    q, k = _with_rope(query, key, query_rope, key_rope)
    n1, n2 = q.shape[1], k.shape[1]
    group = n1 // n2
    logits = scale * torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(group, dim=1))
    logits = logits.masked_fill(~visible, float("-inf"))
    if logits.shape[2] == 0:
        logits = torch.full((n1, q.shape[0], 1), float("-inf"), dtype=torch.float64)
    m = logits.amax(dim=2)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = torch.exp(logits - safe[..., None]).sum(dim=2)
    return (m.reshape(n2, group, -1).transpose(1, 2), s.reshape(n2, group, -1).transpose(1, 2))


def _with_rope(query, key, query_rope, key_rope):
    q, k = query.double(), key.double()
    if query_rope is not None:
        q = torch.cat([q, query_rope.double()], dim=-1)
        k = torch.cat([k, key_rope.double()], dim=-1)
    return q, k


def main_shift(softmax_max, softmax_sum, n1):
    """The main attention's log-sum-exp ``[N1, s1]`` from its statistics ``[N2, s1, G]``; a head
    whose log-sum-exp is -inf (a max of -inf, or a sum of 0) has no target mass: +inf."""
    lse = softmax_max.double() + softmax_sum.double().clamp_min(0).log()
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return lse.transpose(1, 2).reshape(n1, -1)


def indexer_kl_loss(
    query,
    key,
    query_index,
    key_index,
    weights,
    softmax_max,
    softmax_sum,
    scale,
    *,
    query_rope=None,
    key_rope=None,
    visible,
):
    """Reference loss of ``dense_lightning_indexer_grad_kl_loss`` for one sequence, written with
    materialised scores and ``torch.nn.functional.kl_div`` so float64 autograd gives the
    gradients. query ``[s1, N1, D]``, key ``[s2, N2, D]``, query_index ``[s1, N1i, Di]``,
    key_index ``[s2, N2i, Di]``, weights ``[s1, N1i]``, the main statistics ``[N2, s1, G]``.
    The target is the head-summed main attention L1-normalised over the keys; rows whose
    target mass is zero are left out. The indexer's softmax is computed from the scores."""
    q, k = _with_rope(query, key, query_rope, key_rope)
    n1, n2 = q.shape[1], k.shape[1]
    group = n1 // n2
    logits = scale * torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(group, dim=1))
    shift = main_shift(softmax_max, softmax_sum, n1)
    p = torch.where(visible, torch.exp(logits - shift[..., None]), 0.0)
    target = p.sum(dim=0)  # [s1, s2]
    mass = target.sum(dim=1)
    rows = mass > 0
    target = target[rows] / mass[rows, None]
    n1i, n2i = query_index.shape[1], key_index.shape[1]
    igroup = n1i // n2i
    dots = torch.einsum("ihd,jhd->hij", query_index, key_index.repeat_interleave(igroup, dim=1))
    # relu, whose gradient at 0 is 0 ([S > 0] in the docs; clamp_min would pass it).
    scores = torch.einsum("ih,hij->hij", weights, dots.relu())
    scores = scores.reshape(n2i, igroup, *scores.shape[1:]).sum(dim=1)  # [N2i, s1, s2]
    log_q = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    log_q = log_q.masked_fill(~visible, 0.0)[:, rows]
    loss = torch.zeros((), dtype=torch.float64)
    for g in range(n2i):
        loss = loss + torch.nn.functional.kl_div(log_q[g], target, reduction="sum")
    return loss


def sparse_indexer_kl_loss(
    query,
    key,
    query_index,
    key_index,
    weights,
    sparse_indices,
    softmax_max,
    softmax_sum,
    scale,
    *,
    query_rope=None,
    key_rope=None,
    visible,
):
    """Reference loss of ``sparse_lightning_indexer_grad_kl_loss`` for one sequence (float64
    autograd gives the gradients): as :func:`indexer_kl_loss`, with each row's keys restricted
    to the ones its ``sparse_indices`` ``[s1, N2i or 1, K]`` select (token positions, ``-1``
    skipped) among the visible ones, per index key head. The main statistics ``[N2, s1, G]`` are
    the sparse attention's (over the same selected keys)."""
    q, k = _with_rope(query, key, query_rope, key_rope)
    n1, n2 = q.shape[1], k.shape[1]
    group = n1 // n2
    s1, s2 = q.shape[0], k.shape[0]
    logits = scale * torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(group, dim=1))
    shift = main_shift(softmax_max, softmax_sum, n1)
    n1i, n2i = query_index.shape[1], key_index.shape[1]
    igroup = n1i // n2i
    dots = torch.einsum("ihd,jhd->hij", query_index, key_index.repeat_interleave(igroup, dim=1))
    # relu, whose gradient at 0 is 0 ([S > 0] in the docs; clamp_min would pass it).
    scores = torch.einsum("ih,hij->hij", weights, dots.relu())
    scores = scores.reshape(n2i, igroup, s1, s2).sum(dim=1)  # [N2i, s1, s2]
    loss = torch.zeros((), dtype=torch.float64)
    for g in range(n2i):
        picked = torch.zeros((s1, s2), dtype=torch.bool)
        rows = sparse_indices[:, 0 if sparse_indices.shape[1] == 1 else g].long()
        for i in range(s1):
            chosen = rows[i][rows[i] >= 0]
            picked[i, chosen] = True
        selected = picked & visible
        p = torch.where(selected, torch.exp(logits - shift[..., None]), 0.0)
        target = p.sum(dim=0)
        mass = target.sum(dim=1)
        keep = mass > 0
        target = target[keep] / mass[keep, None]
        log_q = torch.log_softmax(scores[g].masked_fill(~selected, float("-inf")), dim=-1)
        log_q = log_q.masked_fill(~selected, 0.0)[keep]
        loss = loss + torch.nn.functional.kl_div(log_q, target, reduction="sum")
    return loss


def _paged_to_dense(key, block_table, k_lengths):
    """Paged keys ``[blocks, block_size, N2, D]`` as BSND ``[B, max_len, N2, D]`` (zeros past each
    sequence's length)."""
    block_size = key.shape[1]
    longest = max([int(n) for n in k_lengths] + [0])
    dense = key.new_zeros(len(k_lengths), longest, *key.shape[2:])
    for b, n in enumerate(k_lengths):
        for j in range(int(n)):
            dense[b, j] = key[int(block_table[b][j // block_size]), j % block_size]
    return dense


def compressed_visible(s1, s2, ratio, residual):
    """Causal visibility of compressed keys ``[s1, s2]``: entry ``s`` stands for the original key
    tokens ``[s * ratio, (s + 1) * ratio)`` of ``s2 * ratio + residual``; query ``i`` sits at
    original position ``i + s2 * ratio + residual - s1`` (bottom-right aligned) and sees the
    entries whose last original token is at or before it."""
    visible = torch.zeros((s1, s2), dtype=torch.bool)
    for i in range(s1):
        position = i + s2 * ratio + residual - s1
        for s in range(s2):
            visible[i, s] = (s + 1) * ratio - 1 <= position
    return visible


def lightning_indexer_scores(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_mode=3,
    pre_tokens=UNBOUNDED,
    next_tokens=UNBOUNDED,
    cmp_ratio=1,
    cmp_residual_key=None,
    **_,
):
    """Reference scores of ``lightning_indexer``: float64 ``[R, N2, L]`` with
    ``I[t, g, s] = sum_{h in group g} w[t, h] relu(q[t, h] . k[s, g])`` for the keys ``s`` row
    ``t`` sees and ``-inf`` elsewhere, and the visibility mask; ``R`` the output rows (``B * S1``
    or ``T1``), ``L`` the longest key sequence."""
    q, k, w = query.double(), key.double(), weights.double()
    tnd = layout_query == "TND"
    if tnd:
        batch = len(actual_seq_lengths_query)
        qcum = [int(x) for x in actual_seq_lengths_query]
        qb = [
            (0 if b == 0 else qcum[b - 1], qcum[b] - (0 if b == 0 else qcum[b - 1]))
            for b in range(batch)
        ]
        rows = q.shape[0]
    else:
        batch, s1 = q.shape[0], q.shape[1]
        lens = (
            [s1] * batch
            if actual_seq_lengths_query is None
            else [int(x) for x in actual_seq_lengths_query]
        )
        qb = [(b * s1, lens[b]) for b in range(batch)]
        q, w = q.flatten(0, 1), w.flatten(0, 1)
        rows = batch * s1
    if layout_key == "PA_BSND":
        k_lens = [int(x) for x in actual_seq_lengths_key]
        dense = _paged_to_dense(k, block_table, k_lens)
        kb = [(dense[b], k_lens[b]) for b in range(batch)]
    elif layout_key == "TND":
        kcum = [int(x) for x in actual_seq_lengths_key]
        kb = []
        for b in range(batch):
            k0 = 0 if b == 0 else kcum[b - 1]
            kb.append((k[k0 : kcum[b]], kcum[b] - k0))
    else:
        s2 = k.shape[1]
        lens = (
            [s2] * batch
            if actual_seq_lengths_key is None
            else [int(x) for x in actual_seq_lengths_key]
        )
        kb = [(k[b, : lens[b]], lens[b]) for b in range(batch)]
    n1, n2 = q.shape[1], k.shape[-2]
    group = n1 // n2 if n2 else 0
    longest = max([n for _, n in kb] + [0])
    scores = torch.full((rows, n2, longest), float("-inf"), dtype=torch.float64)
    visible_all = torch.zeros((rows, n2, longest), dtype=torch.bool)
    for b in range(batch):
        q0, s1 = qb[b]
        keys, s2 = kb[b]
        if cmp_ratio > 1 and sparse_mode == 3:
            residual = 0 if cmp_residual_key is None else int(cmp_residual_key[b])
            visible = compressed_visible(s1, s2, cmp_ratio, residual)
        else:
            visible = indexer_visible(s1, s2, sparse_mode, pre_tokens, next_tokens)
        for g in range(n2):
            heads = slice(g * group, (g + 1) * group)
            dots = torch.einsum("ihd,jd->ihj", q[q0 : q0 + s1, heads], keys[:s2, g])
            s = torch.einsum("ih,ihj->ij", w[q0 : q0 + s1, heads], dots.clamp_min(0))
            scores[q0 : q0 + s1, g, :s2] = s.masked_fill(~visible, float("-inf"))
            visible_all[q0 : q0 + s1, g, :s2] = visible
    return scores, visible_all


def lightning_indexer(query, key, weights, *, sparse_count=2048, **kwargs):
    """Reference for ``lightning_indexer``: ``(indices int64, values float64)`` of shape
    ``[R, N2, K]``: the visible keys by descending score, ties to the lower position (a stable
    sort), ``-1`` / ``-inf`` past the visible ones."""
    scores, visible = lightning_indexer_scores(query, key, weights, **kwargs)
    rows, n2, longest = scores.shape
    indices = torch.full((rows, n2, sparse_count), -1, dtype=torch.int64)
    values = torch.full((rows, n2, sparse_count), float("-inf"), dtype=torch.float64)
    order = torch.sort(
        scores.masked_fill(~visible, float("-inf")), dim=-1, descending=True, stable=True
    )
    count = visible.sum(-1).clamp(max=sparse_count)
    take = min(sparse_count, longest)
    keep = torch.arange(take)[None, None, :] < count[..., None]
    indices[..., :take] = torch.where(keep, order.indices[..., :take], -1)
    values[..., :take] = torch.where(keep, order.values[..., :take], float("-inf"))
    return indices, values


def sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    *,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    query_rope=None,
    key_rope=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=UNBOUNDED,
    next_tokens=UNBOUNDED,
    sinks=None,
    softcap=None,
    **_,
):
    """Reference for ``sparse_flash_attention`` in float64 torch ops (differentiable, so its
    gradients are the reference gradients): ``(out [R, N1, Dv], max [R, N1], sum [R, N1])``
    with ``R`` the output rows (``B * S1`` or ``T1``); rows selecting nothing give ``0`` and
    ``(-inf, 0)``."""
    q = query if layout_query == "TND" else query.flatten(0, 1)
    qr = (
        None
        if query_rope is None
        else (query_rope if layout_query == "TND" else query_rope.flatten(0, 1))
    )
    idx = sparse_indices if layout_query == "TND" else sparse_indices.flatten(0, 1)
    tnd = layout_query == "TND"
    if tnd:
        cum = [int(x) for x in actual_seq_lengths_query]
        qb = [
            (0 if b == 0 else cum[b - 1], cum[b] - (0 if b == 0 else cum[b - 1]))
            for b in range(len(cum))
        ]
    else:
        s1 = query.shape[1]
        lens = (
            [s1] * query.shape[0]
            if actual_seq_lengths_query is None
            else [int(x) for x in actual_seq_lengths_query]
        )
        qb = [(b * s1, lens[b]) for b in range(query.shape[0])]
    batch = len(qb)

    def keys_of(t, b):
        if t is None:
            return None
        if layout_kv == "PA_BSND":
            n = int(actual_seq_lengths_kv[b])
            return _paged_to_dense(t, block_table, actual_seq_lengths_kv)[b, :n]
        if layout_kv == "TND":
            cum = [int(x) for x in actual_seq_lengths_kv]
            return t[(0 if b == 0 else cum[b - 1]) : cum[b]]
        n = t.shape[1] if actual_seq_lengths_kv is None else int(actual_seq_lengths_kv[b])
        return t[b, :n]

    n1, n2 = q.shape[-2], key.shape[-2]
    group = n1 // n2 if n2 else 0
    rows = q.shape[0]
    zero = q.new_zeros(value.shape[-1], dtype=torch.float64)
    outs = [[zero] * n1 for _ in range(rows)]
    smax = torch.full((rows, n1), float("-inf"), dtype=torch.float64)
    ssum = torch.zeros((rows, n1), dtype=torch.float64)
    for b in range(batch):
        q0, sq = qb[b]
        k, v, kr = keys_of(key, b), keys_of(value, b), keys_of(key_rope, b)
        sk = k.shape[0]
        visible = indexer_visible(sq, sk, sparse_mode, pre_tokens, next_tokens)
        for i in range(sq):
            for h in range(n1):
                g = h // group
                sel_row = idx[q0 + i, 0 if idx.shape[-2] == 1 else g]
                chosen = []
                for blk in sel_row.tolist():
                    if blk < 0:
                        continue
                    for j in range(blk * sparse_block_size, min((blk + 1) * sparse_block_size, sk)):
                        if visible[i, j]:
                            chosen.append(j)
                if not chosen:
                    outs[q0 + i][h] = zero
                    continue
                sel = torch.tensor(chosen)
                s = k[sel, g].double() @ q[q0 + i, h].double()
                if qr is not None:
                    s = s + kr[sel, g].double() @ qr[q0 + i, h].double()
                s = s * scale_value
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                m = s.max()
                e = torch.exp(s - m)
                denom = e.sum()
                smax[q0 + i, h] = m.detach()
                ssum[q0 + i, h] = denom.detach()
                if sinks is not None:
                    denom = denom + torch.exp(sinks[h].double() - m)
                outs[q0 + i][h] = (e / denom) @ v[sel, g].double()
    out = (
        torch.stack([torch.stack(r) for r in outs])
        if rows
        else q.new_zeros((0, n1, value.shape[-1]), dtype=torch.float64)
    )
    return out, smax, ssum


def _mla_rows(x, b, begin, length, layout, table=None):
    """Sequence b's first ``length`` rows of a BSND / TND / paged (PA_BBND) tensor."""
    if layout == "BSND":
        return x[b, :length]
    if layout == "TND":
        return x[begin : begin + length]
    size = x.shape[1]
    return (
        torch.stack([x[int(table[b][j // size]), j % size] for j in range(length)])
        if length
        else x[0, :0]
    )


def _mla_visible_ori(i, q_len, k_len, mode, left, right):
    """Original keys row i sees: mode 0 all, 3 causal (bottom-right), 4 the window."""
    diag = i + k_len - q_len
    keys = range(k_len)
    if mode == 3:
        return [j for j in keys if j <= diag]
    if mode == 4:
        return [
            j for j in keys if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
        ]
    return list(keys)


def sparse_flash_mla(
    q,
    *,
    ori_kv=None,
    cmp_kv=None,
    ori_sparse_indices=None,
    cmp_sparse_indices=None,
    ori_block_table=None,
    cmp_block_table=None,
    cu_seqlens_q=None,
    cu_seqlens_ori_kv=None,
    cu_seqlens_cmp_kv=None,
    seqused_q=None,
    seqused_ori_kv=None,
    seqused_cmp_kv=None,
    cmp_residual_kv=None,
    ori_topk_length=None,
    cmp_topk_length=None,
    sinks=None,
    softmax_scale=1.0,
    cmp_ratio=1,
    ori_mask_mode=4,
    cmp_mask_mode=3,
    ori_win_left=-1,
    ori_win_right=-1,
    layout_q="BSND",
    layout_kv="BSND",
):
    """sparse_flash_mla in float64, row by row (docs/ops/sparse_flash_mla.md): a row's keys are
    ori_kv's it may see (or those ori_sparse_indices names among them) then cmp_kv's (likewise);
    one softmax over their scores ``softmax_scale * q . kv`` and the sink; the output is the
    probability-weighted sum of the same rows. Returns ``(out [R, N1, D], lse [R, N1])`` over the
    query rows R (BSND flattened), lse including the sink (``-inf`` with neither key nor sink);
    rows outside every sequence and rows with no key give zeros."""
    call = dict(locals())
    tnd = layout_q == "TND"
    n1, d = q.shape[-2], q.shape[-1]
    qd = q.double()
    batch = len(cu_seqlens_q) - 1 if tnd else q.shape[0]
    rows = q.shape[0] if tnd else q.shape[0] * q.shape[1]
    out = torch.zeros(rows, n1, d, dtype=torch.float64)
    sink = sinks.double() if sinks is not None else None
    lse = (
        sink.expand(rows, n1)
        if sink is not None
        else torch.full((rows, n1), -torch.inf, dtype=torch.float64)
    ).clone()

    def seq_len(b, cu, used, tensor, kv_layout):
        if kv_layout == "TND":
            begin, length = int(cu[b]), int(cu[b + 1]) - int(cu[b])
        elif kv_layout == "BSND":
            begin, length = 0, tensor.shape[1]
        else:
            begin, length = 0, None
        if used is not None:
            length = int(used[b])
        return begin, length

    for b in range(batch):
        qb, ql = seq_len(b, cu_seqlens_q, seqused_q, q, layout_q)
        sides = []
        for name in ("ori", "cmp"):
            kv, idx, topk = (
                call[f"{name}_kv"],
                call[f"{name}_sparse_indices"],
                call[f"{name}_topk_length"],
            )
            cu, used = call[f"cu_seqlens_{name}_kv"], call[f"seqused_{name}_kv"]
            table = call[f"{name}_block_table"]
            if kv is None:
                continue
            kb, kl = seq_len(b, cu, used, kv, layout_kv)
            keys = _mla_rows(kv.double(), b, kb, kl, layout_kv, table)
            sides.append((name, keys, kl, idx, topk))
        for i in range(ql):
            row = qb + i if tnd else b * q.shape[1] + i
            qrow = qd[row] if tnd else qd[b, i]
            for h in range(n1):
                g = h // (n1 // sides[0][1].shape[-2]) if sides else 0
                chosen = []
                for name, keys, kl, idx, topk in sides:
                    if name == "ori":
                        vis = _mla_visible_ori(
                            i, ql, kl, ori_mask_mode, ori_win_left, ori_win_right
                        )
                    elif cmp_mask_mode == 3:
                        res = int(cmp_residual_kv[b]) if cmp_residual_kv is not None else 0
                        position = i + kl * cmp_ratio + res - ql
                        vis = [j for j in range(kl) if (j + 1) * cmp_ratio - 1 <= position]
                    else:
                        vis = list(range(kl))
                    if idx is not None:
                        sel = idx[row] if tnd else idx[b, i]
                        count = sel.shape[-1]
                        if topk is not None:
                            count = int((topk[row] if tnd else topk[b, i])[g])
                        picked = [int(v) for v in sel[g, :count] if int(v) >= 0]
                        vis = [j for j in picked if j in set(vis)]
                    chosen.extend(keys[j, g] for j in vis)
                if not chosen:
                    continue
                kv_rows = torch.stack(chosen)
                scores = softmax_scale * (kv_rows @ qrow[h])
                all_scores = scores if sink is None else torch.cat([scores, sink[h : h + 1]])
                total = torch.logsumexp(all_scores, 0)
                lse[row, h] = total
                out[row, h] = torch.exp(scores - total) @ kv_rows
    return out, lse


def compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, *, state_block_table=None,
               cu_seqlens=None, seqused=None, start_pos=None, coff=1, cache_mode=1):  # fmt: skip
    """DeepSeek-V4's compressor in float64, position by position (differentiable in x, wkv,
    wgate and ape). Token p of a sequence (p = start_pos[b] + i) has kv_p = wkv x_p and
    score_p = wgate x_p + ape[p % r]; entry w, emitted when the call holds position
    (w + 1) r - 1, is sum_j softmax_j(score_j[c]) kv_j[c] over window w's positions (channels
    [0, D)), or with coff = 2 over window w - 1's on channels [0, D) and window w's on [D, 2D).
    Positions before start_pos come from state_cache rows [kv | score]. Returns (cmp_kv [B,
    ceil(S / r), D] or [min(T, T // r + B), D], the state cache after the call (or None))."""
    r, d = cmp_ratio, wkv.shape[0] // coff
    packed = x.dim() == 2
    batch = len(cu_seqlens) - 1 if packed else x.shape[0]
    if packed:
        out = torch.zeros(min(x.shape[0], x.shape[0] // r + batch), d, dtype=torch.float64)
    else:
        out = torch.zeros(batch, -(-x.shape[1] // r), d, dtype=torch.float64)
    state = None if state_cache is None else state_cache.double().clone()
    block_size = 0 if state is None else state.shape[1]

    def block(b, p):
        table = state_block_table[b]
        return int(table) if cache_mode == 2 else int(table[p // block_size])

    wkv, wgate, ape = wkv.double(), wgate.double(), ape.double()
    written = []
    row_out = 0
    for b in range(batch):
        rows = x[int(cu_seqlens[b]) : int(cu_seqlens[b + 1])] if packed else x[b]
        used = int(seqused[b]) if seqused is not None else rows.shape[0]
        start = int(start_pos[b]) if start_pos is not None else 0
        tok = rows[:used].double()
        pos = torch.arange(start, start + used)
        kv = tok @ wkv.T
        score = tok @ wgate.T + ape[pos % r]

        def row(p, b=b, start=start, kv=kv, score=score):
            if p >= start:
                return kv[p - start], score[p - start]
            cached = state[block(b, p), p % block_size]
            return cached[: coff * d], cached[coff * d :]

        if not packed:
            row_out = 0
        for w in range(start // r, (start + used) // r):
            slots = []
            if coff == 2 and w >= 1:
                slots += [(row(p), 0) for p in range((w - 1) * r, w * r)]
            slots += [(row(p), d if coff == 2 else 0) for p in range(w * r, (w + 1) * r)]
            kvs = torch.stack([k[c : c + d] for (k, _), c in slots])
            scores = torch.stack([s[c : c + d] for (_, s), c in slots])
            entry = (torch.softmax(scores, dim=0) * kvs).sum(0)
            if packed:
                out[row_out] = entry
            else:
                out[b, row_out] = entry
            row_out += 1
        if state is not None:
            written.append(
                [(b, p, torch.cat([kv[p - start], score[p - start]])) for p in pos.tolist()]
            )
    for seq in written:  # after every read: a call reads the state as it found it
        for b, p, values in seq:
            if block(b, p) != 0:
                state[block(b, p), p % block_size] = values.detach()
    return out, state
