"""FlashAttnPlan: planned once per step, run by every layer; the decode helper advances the
lengths of a paged cache. Results equal direct opmesh.flash_attn calls with the same arguments."""

import pytest
import torch

import opmesh


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_dense_plan_is_reused_by_every_layer():
    plan = opmesh.FlashAttnPlan(8, 2, 16, causal=True, softmax_scale=0.2)
    plan.plan(batch_size=3, seqlen_q=11, seqlen_kv=11)
    described = opmesh.describe_metadata(plan.metadata)
    assert described["batch_size"] == 3
    for layer in range(3):
        q, k, v = (
            randn(3, 11, 8, 16, seed=layer),
            randn(3, 11, 2, 16, seed=10 + layer),
            randn(3, 11, 2, 16, seed=20 + layer),
        )
        got, lse = plan.run(q, k, v, return_softmax_lse=True)
        want, want_lse = opmesh.flash_attn(
            q, k, v, mask_mode=3, softmax_scale=0.2, return_softmax_lse=True
        )
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_varlen_plan_with_a_window():
    cu_q = torch.tensor([0, 5, 5, 18], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 10, 30], dtype=torch.int32)
    plan = opmesh.FlashAttnPlan(4, 4, 16, window_size=(3, 2), layout="TND")
    plan.plan(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k)
    q, k, v = randn(18, 4, 16, seed=1), randn(30, 4, 16, seed=2), randn(30, 4, 16, seed=3)
    want, _ = opmesh.flash_attn(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, mask_mode=4, win_left=3, win_right=2,
        layout_q="TND", layout_kv="TND", layout_out="TND",
    )  # fmt: skip
    torch.testing.assert_close(plan.run(q, k, v), want, rtol=1e-6, atol=1e-6)


def test_paged_decode_loop_one_plan_per_step():
    """Two layers decode 5 steps into their own paged caches; each step makes one plan
    (advance) that both layers use. Every step's output equals attention over the sequence so
    far."""
    batch, heads, kv_heads, dim, page, steps = 3, 4, 2, 16, 4, 5
    prompt = torch.tensor([3, 0, 6], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    caches = [(torch.zeros(9, page, kv_heads, dim), torch.zeros(9, page, kv_heads, dim))
              for _ in range(2)]  # fmt: skip
    shape = (batch, 12, kv_heads, dim)
    history = [(randn(*shape, seed=5 + layer), randn(*shape, seed=7 + layer)) for layer in range(2)]
    plan = opmesh.FlashAttnPlan(heads, kv_heads, dim, causal=True)
    plan.plan(batch_size=batch, seqlen_q=1, seqused_kv=prompt, block_table=table, page_size=page)
    # The prompts' keys and values go in first, through the same slots computation.
    slots = [
        int(table[b, j // page]) * page + j % page for b in range(batch) for j in range(prompt[b])
    ]
    for (kc, vc), (hk, hv) in zip(caches, history, strict=True):
        rows = [(b, j) for b in range(batch) for j in range(prompt[b])]
        ks = torch.stack([hk[b, j] for b, j in rows])
        vs = torch.stack([hv[b, j] for b, j in rows])
        opmesh.kv_cache_write_(ks, vs, kc, vc, slots)
    for step in range(steps):
        slots = plan.advance(1)  # one plan for this step
        assert plan.seqused_kv.tolist() == (prompt + step + 1).tolist()
        for layer, ((kc, vc), (hk, hv)) in enumerate(zip(caches, history, strict=True)):
            position = prompt + step  # each sequence's new token
            k_new = torch.stack([hk[b, position[b]] for b in range(batch)])
            v_new = torch.stack([hv[b, position[b]] for b in range(batch)])
            opmesh.kv_cache_write_(k_new, v_new, kc, vc, slots)
            q = randn(batch, 1, heads, dim, seed=100 * step + layer)
            got = plan.run(q, kc, vc)
            for b in range(batch):
                n = int(position[b]) + 1
                want, _ = opmesh.flash_attn(q[b : b + 1], hk[b : b + 1, :n], hv[b : b + 1, :n],
                                            mask_mode=3)  # fmt: skip
                torch.testing.assert_close(got[b : b + 1], want, rtol=1e-6, atol=1e-6)


def test_plan_errors_are_named():
    plan = opmesh.FlashAttnPlan(4, 2, 16)
    q = randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="^plan: call plan"):
        plan.run(q, q[:, :, :2], q[:, :, :2])
    with pytest.raises(ValueError, match="^batch_size, seqlen_q: required"):
        plan.plan(seqlen_kv=3)
    with pytest.raises(ValueError, match="^cu_seqlens_q: required to plan layout TND"):
        opmesh.FlashAttnPlan(4, 2, 16, layout="TND").plan()
    with pytest.raises(ValueError, match="^layout: expected"):
        opmesh.FlashAttnPlan(4, 2, 16, layout="SBND")
    paged = opmesh.FlashAttnPlan(4, 2, 16).plan(
        batch_size=1, seqlen_q=1, seqused_kv=[2], block_table=torch.zeros(1, 1, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="^page_size: advance needs"):
        paged.advance(1)
    with pytest.raises(ValueError, match="^advance: needs a plan with a block_table"):
        opmesh.FlashAttnPlan(4, 2, 16).plan(batch_size=1, seqlen_q=1, seqlen_kv=2).advance(1)
    with pytest.raises(ValueError, match="^seqused_kv: required with a block_table"):
        opmesh.FlashAttnPlan(4, 2, 16).plan(
            batch_size=1, seqlen_q=1, block_table=torch.zeros(1, 1, dtype=torch.int32)
        )


def test_tnd_queries_on_a_paged_cache():
    cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    k_cache, v_cache = randn(9, 4, 2, 32, seed=1), randn(9, 4, 2, 32, seed=2)
    used = torch.tensor([5, 0, 12], dtype=torch.int32)
    plan = opmesh.FlashAttnPlan(8, 2, 32, causal=True, layout="TND")
    plan.plan(cu_seqlens_q=cu_q, seqused_kv=used, block_table=table, page_size=4)
    q = randn(7, 8, 32, seed=3)
    want, _ = opmesh.flash_attn(
        q, k_cache, v_cache, cu_seqlens_q=cu_q, block_table=table, seqused_kv=used,
        layout_q="TND", mask_mode=3,
    )  # fmt: skip
    torch.testing.assert_close(plan.run(q, k_cache, v_cache), want, rtol=1e-6, atol=1e-6)
