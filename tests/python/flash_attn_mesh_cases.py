"""flash_attn on real process groups (gloo, spawned processes), run by test_flash_attn_mesh.py.

Every case distributes the same inputs as the single-device call that every rank computes
itself, runs forward and backward on DTensors, and compares the output, the lse and the
gradients of q, k, v (and sinks) with the single-device ones (float32, within 1e-5 of the
largest entry). Sizes that do not divide the mesh are included.
"""

from __future__ import annotations

import torch
from mesh_runner import expect_error as _expect
from torch.distributed.tensor import DTensor

import opmesh
from opmesh import Partial, Replicate, Shard

R = Replicate()


def _inputs(b, s1, s2, nq, nkv, d=16, dv=16, layout="BSND", seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(s, n, dim):
        shape = (b, s, n, dim) if layout == "BSND" else (b, n, s, dim)
        return torch.randn(*shape, generator=g)

    return make(s1, nq, d), make(s2, nkv, d), make(s2, nkv, dv)


def _close(got, want, what):
    full = got.full_tensor() if isinstance(got, DTensor) else got
    assert full.shape == want.shape, f"{what}: shape {tuple(full.shape)}, want {tuple(want.shape)}"
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(full), finite), f"{what}: infinities differ"
    scale = want[finite].abs().max().clamp_min(1e-6) if finite.any() else 1.0
    err = (full - want)[finite].abs().max().item() if finite.any() else 0.0
    assert err <= 1e-5 * scale, f"{what}: error {err:.2e} (largest entry {float(scale):.2e})"


def _check(
    mesh,
    placements,
    b=2,
    s1=9,
    s2=9,
    nq=4,
    nkv=2,
    sinks=None,
    layout="BSND",
    context_parallel="all_gather",
    **kw,
):
    """placements: (q, k, v[, sinks]) per-tensor placements; kw: flash_attn's options."""
    q, k, v = _inputs(b, s1, s2, nq, nkv, layout=layout)
    options = dict(layout_q=layout, layout_kv=layout, layout_out=layout, **kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    sink_leaf = None
    if sinks is not None:
        sink_leaf = torch.linspace(-1.0, 1.0, nq).requires_grad_()
        options["sinks"] = sink_leaf
    out, lse = opmesh.flash_attn(*leaves, return_softmax_lse=True, **options)
    gen = torch.Generator().manual_seed(9)
    dout = torch.randn(out.shape, generator=gen)
    dlse = torch.randn(lse.shape, generator=gen)
    ((out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()).backward()
    want = [out.detach(), lse.detach()] + [x.grad for x in leaves]

    dist_leaves = [
        opmesh.distribute_tensor(x.detach(), mesh, pl).requires_grad_()
        for x, pl in zip((q, k, v), placements[:3], strict=True)
    ]
    dist_options = dict(options)
    dsink = None
    if sinks is not None:
        dsink = opmesh.distribute_tensor(sink_leaf.detach(), mesh, sinks).requires_grad_()
        dist_options["sinks"] = dsink
    got_out, got_lse = opmesh.flash_attn(
        *dist_leaves, return_softmax_lse=True, context_parallel=context_parallel, **dist_options
    )
    assert isinstance(got_out, DTensor) and isinstance(got_lse, DTensor)
    d_dout = opmesh.distribute_tensor(dout, mesh, got_out.placements)
    d_dlse = opmesh.distribute_tensor(dlse, mesh, got_lse.placements)
    finite = torch.isfinite(got_lse.to_local())
    lse_term = opmesh.distribute_tensor(
        torch.zeros(()), mesh, [R] * mesh.ndim
    )  # a scalar DTensor to add the two sums on
    loss = (got_out * d_dout).sum() + lse_term
    loss = loss + (
        DTensor.from_local(
            torch.where(finite, got_lse.to_local(), 0), mesh, got_lse.placements,
            shape=got_lse.shape, stride=got_lse.stride(),
        ) * d_dlse
    ).sum()  # fmt: skip
    loss.backward()
    names = ["out", "lse", "dq", "dk", "dv"]
    got = [got_out, got_lse] + [x.grad for x in dist_leaves]
    for name, g, w in zip(names, got, want, strict=True):
        _close(g, w, name)
    if sinks is not None:
        _close(dsink.grad, sink_leaf.grad, "dsinks")


def _check_head_tail(mesh, order, kv_sharded, b=1, s1=None, nq=4, nkv=2, mask_mode=3, **kw):
    """Inputs in head-tail order `order` (keys and values too when sharded), outputs converted
    back, gradients compared in natural order."""
    cp = mesh.size(0)
    s1 = s1 or 4 * cp
    q, k, v = _inputs(b, s1, s1, nq, nkv)
    options = dict(mask_mode=mask_mode, **kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = opmesh.flash_attn(*leaves, return_softmax_lse=True, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * dout).sum().backward()
    S1 = [Shard(1)]

    def ht(x, dim=1):
        return opmesh.to_head_tail(x, dim, cp, order=order)

    dq = opmesh.distribute_tensor(ht(q), mesh, S1).requires_grad_()
    kv_place = S1 if kv_sharded else [R]
    dk = opmesh.distribute_tensor(ht(k) if kv_sharded else k, mesh, kv_place).requires_grad_()
    dv = opmesh.distribute_tensor(ht(v) if kv_sharded else v, mesh, kv_place).requires_grad_()
    with opmesh.head_tail_cp(order):
        got, got_lse = opmesh.flash_attn(dq, dk, dv, return_softmax_lse=True, **options)
    (got * opmesh.distribute_tensor(ht(dout), mesh, got.placements)).sum().backward()

    def back(x, dim=1):
        return opmesh.from_head_tail(x.full_tensor(), dim, cp, order=order)

    _close(back(got), out.detach(), "out")
    _close(back(got_lse, 2), lse.detach(), "lse")
    _close(back(dq.grad), leaves[0].grad, "dq")
    for name, g, leaf in (("dk", dk.grad, leaves[1]), ("dv", dv.grad, leaves[2])):
        _close(back(g) if kv_sharded else g, leaf.grad, name)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _tnd_inputs(q_lens, k_lens, nq, nkv, d, **kw):
    """q, k, v of a TND batch, and flash_attn's TND options with the global cu_seqlens."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(q_lens), nq, d, generator=g)
    k = torch.randn(sum(k_lens), nkv, d, generator=g)
    v = torch.randn(sum(k_lens), nkv, d, generator=g)
    options = dict(
        layout_q="TND", layout_kv="TND", layout_out="TND", cu_seqlens_q=_cu(q_lens),
        cu_seqlens_kv=_cu(k_lens), **kw,
    )  # fmt: skip
    return q, k, v, options


def _check_tnd(mesh, q_lens, k_lens, placements, nq=4, nkv=2, d=16, sinks=None, **kw):
    """TND varlen: the global cu_seqlens as plain tensors, q's tokens sharded or not; `sinks`:
    the sinks' placements (None: no sinks)."""
    q, k, v, options = _tnd_inputs(q_lens, k_lens, nq, nkv, d, **kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    sink_leaf = torch.linspace(-1.0, 1.0, nq).requires_grad_() if sinks is not None else None
    out, lse = opmesh.flash_attn(*leaves, sinks=sink_leaf, return_softmax_lse=True, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * dout).sum().backward()
    dist_leaves = [
        opmesh.distribute_tensor(x.detach(), mesh, pl).requires_grad_()
        for x, pl in zip((q, k, v), placements, strict=True)
    ]
    dsinks = None
    if sinks is not None:
        dsinks = opmesh.distribute_tensor(sink_leaf.detach(), mesh, sinks).requires_grad_()
    got, got_lse = opmesh.flash_attn(*dist_leaves, sinks=dsinks, return_softmax_lse=True, **options)
    (got * opmesh.distribute_tensor(dout, mesh, got.placements)).sum().backward()
    _close(got, out.detach(), "out")
    _close(got_lse, lse.detach(), "lse")
    for name, x, leaf in zip(("dq", "dk", "dv"), dist_leaves, leaves, strict=True):
        _close(x.grad, leaf.grad, name)
    if sinks is not None:
        _close(dsinks.grad, sink_leaf.grad, "dsinks")


def _check_tnd_head_tail(mesh, order, q_lens, k_lens, kv_sharded, nq=4, nkv=2, d=16, **kw):
    """TND in head-tail order (every sequence cut into 2 * cp chunks): q, and k and v when
    sharded, given in that order; outputs and gradients converted back and compared."""
    cp = mesh.size(0)
    q, k, v, options = _tnd_inputs(q_lens, k_lens, nq, nkv, d, **kw)
    cu_q, cu_k = options["cu_seqlens_q"], options["cu_seqlens_kv"]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = opmesh.flash_attn(*leaves, return_softmax_lse=True, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * dout).sum().backward()

    def ht(x, cu_, dim=0):
        return opmesh.to_head_tail(x, dim, cp, order, cu_seqlens=cu_)

    def back(x, cu_, dim=0):
        return opmesh.from_head_tail(x.full_tensor(), dim, cp, order, cu_seqlens=cu_)

    S0 = [Shard(0)]
    dq = opmesh.distribute_tensor(ht(q, cu_q), mesh, S0).requires_grad_()
    dk, dv = (
        opmesh.distribute_tensor(
            ht(x, cu_k) if kv_sharded else x, mesh, S0 if kv_sharded else [R]
        ).requires_grad_()
        for x in (k, v)
    )
    with opmesh.head_tail_cp(order):
        got, got_lse = opmesh.flash_attn(dq, dk, dv, return_softmax_lse=True, **options)
    (got * opmesh.distribute_tensor(ht(dout, cu_q), mesh, got.placements)).sum().backward()
    _close(back(got, cu_q), out.detach(), "out")
    _close(back(got_lse, cu_q, 1), lse.detach(), "lse")
    _close(back(dq.grad, cu_q), leaves[0].grad, "dq")
    for name, x, leaf in (("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        _close(back(x.grad, cu_k) if kv_sharded else x.grad, leaf.grad, name)


def _aligned_lengths(m, t1, t2):
    """Sequence lengths whose query and key tokens, split m ways as DTensor splits them, give
    every rank whole sequences: two per rank (some empty) plus an empty one between ranks."""
    q_lens, k_lens = [], []
    for r in range(m):
        c1, c2 = -(-t1 // m), -(-t2 // m)
        lq = max(0, min(t1, (r + 1) * c1) - min(t1, r * c1))
        lk = max(0, min(t2, (r + 1) * c2) - min(t2, r * c2))
        q_lens += [lq // 2, lq - lq // 2, 0]
        k_lens += [lk - lk // 3, lk // 3, 0]
    return q_lens, k_lens


class _NoGather:
    """Fails any redistribute (all-gather) made inside the block."""

    def __enter__(self):
        self.platform = opmesh.platform.current()
        self.saved = self.platform.redistribute

        def refuse(*args, **kwargs):
            raise AssertionError("keys and values were gathered")

        self.platform.redistribute = refuse

    def __exit__(self, *exc):
        self.platform.redistribute = self.saved


def case_tnd_data_parallel(mesh, **kw):
    """q's and k/v's tokens sharded alike with whole sequences per rank: each rank attends its
    own sequences (no gather), any mask."""
    m = mesh.size(0)
    q_lens, k_lens = _aligned_lengths(m, 5 * m + 1, 7 * m - 1)
    placements = [Shard(0)]
    if mesh.ndim == 2:  # heads over the second axis, replicated sinks sliced to them
        t = mesh.size(1)
        placements.append(Shard(1))
        kw.update(nq=2 * t, nkv=t, sinks=[R, R])
    with _NoGather():
        _check_tnd(mesh, q_lens, k_lens, (placements,) * 3, **kw)


def case_errors(mesh):
    m = mesh.size(0)
    q, k, v = _inputs(2, 8, 8, 4, 2)

    def dt(x, pl):
        return opmesh.distribute_tensor(x, mesh, [pl])

    _expect(
        ValueError,
        "q: dim 3 (D) is sharded",
        lambda: opmesh.flash_attn(dt(q, Shard(3)), dt(k, R), dt(v, R)),
    )
    _expect(
        ValueError,
        "k: dim 0 (B) is sharded",
        lambda: opmesh.flash_attn(dt(q, R), dt(k, Shard(0)), dt(v, R)),
    )
    cu = torch.tensor([0, 8], dtype=torch.int32)
    _expect(
        ValueError,
        "win_right: TND context parallel supports windows with win_right=0",
        lambda: opmesh.flash_attn(
            dt(q[0], Shard(0)), dt(k[0], R), dt(v[0], R), layout_q="TND", layout_kv="TND",
            layout_out="TND", cu_seqlens_q=cu, cu_seqlens_kv=cu, mask_mode=4, win_left=2,
            win_right=1,
        ),
    )  # fmt: skip
    _expect(
        ValueError,
        "layout_q: TND context parallel",
        lambda: opmesh.flash_attn(
            dt(q[0], Shard(0)), dt(k[0], R), dt(v[0], R), layout_q="TND", layout_kv="TND",
            layout_out="TND", cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor([0, 8], dtype=torch.int32), mask_mode=3,
            context_parallel="ring",
        ),
    )  # fmt: skip
    kq, vq = k.to(torch.int8), v.to(torch.int8)
    scale = torch.ones(k.shape[:-1])
    _expect(
        ValueError,
        "k_scale: a quantized cache is read on one device",
        lambda: opmesh.flash_attn(
            dt(q, Shard(2)), dt(kq, Shard(2)), dt(vq, Shard(2)), k_scale=dt(scale, Shard(2)),
            v_scale=dt(scale, Shard(2)),
        ),
    )  # fmt: skip
    partial = DTensor.from_local(k / m, mesh, [Partial()])
    _expect(
        ValueError, "k: Partial placement", lambda: opmesh.flash_attn(dt(q, R), partial, dt(v, R))
    )
    # Heads that would cut a query group from its key head: N2 = m + 1, N1 = 2 (m + 1).
    q2, k2, v2 = _inputs(1, 4, 4, 2 * (m + 1), m + 1)
    _expect(
        ValueError,
        "q: dim 2 (N1) is sharded",
        lambda: opmesh.flash_attn(dt(q2, Shard(2)), dt(k2, Shard(2)), dt(v2, Shard(2))),
    )


def _slopes(rows, nq):
    """ALiBi slopes, [nq] (rows None) or [rows, nq]."""
    n = nq if rows is None else rows * nq
    s = torch.linspace(0.05, 0.6, n)
    return s if rows is None else s.view(rows, nq)


def case_score_mods_tnd_dp(mesh):
    """TND data parallel with slopes per sequence: each rank takes its sequences' rows."""
    m = mesh.size(0)
    q_lens, k_lens = _aligned_lengths(m, 5 * m + 1, 7 * m - 1)
    with _NoGather():
        _check_tnd(
            mesh, q_lens, k_lens, ([Shard(0)],) * 3, mask_mode=3, softcap=1.5,
            alibi_slopes=_slopes(len(q_lens), 4),
        )  # fmt: skip


def case_score_mods_errors(mesh):
    """ALiBi where a local call would not keep the global diagonal, and sharded slopes."""
    q, k, v = _inputs(2, 8, 8, 4, 2)
    S1 = [Shard(1)]
    dq, dk, dv = (opmesh.distribute_tensor(x, mesh, S1) for x in (q, k, v))
    slopes = _slopes(None, 4)
    _expect(
        ValueError,
        "alibi_slopes: ALiBi runs on a sharded query sequence",
        lambda: opmesh.flash_attn(
            dq, dk, dv, mask_mode=3, alibi_slopes=slopes, context_parallel="ring"
        ),
    )
    _expect(
        ValueError,
        "alibi_slopes: with context_parallel='all_gather' ALiBi needs mask_mode=3",
        lambda: opmesh.flash_attn(dq, dk, dv, alibi_slopes=slopes),
    )
    sharded = opmesh.distribute_tensor(slopes, mesh, [Shard(0)])
    _expect(
        ValueError,
        "alibi_slopes: dim 0 is sharded",
        lambda: opmesh.flash_attn(dq, dk, dv, mask_mode=3, alibi_slopes=sharded),
    )


def cases(mesh):
    m = mesh.size(0)
    S0, S1, S2 = Shard(0), Shard(1), Shard(2)
    return {
        "replicated": lambda: _check(mesh, ([R], [R], [R]), mask_mode=3),
        "dp_uneven_batch_3": lambda: _check(mesh, ([S0], [S0], [S0]), b=3, mask_mode=3),
        "tp_heads": lambda: _check(mesh, ([S2], [S2], [S2]), nq=2 * m, nkv=m, mask_mode=3),
        "tp_heads_sinks_sharded": lambda: _check(
            mesh, ([S2], [S2], [S2]), nq=2 * m, nkv=m, mask_mode=3, sinks=[S0]
        ),
        "tp_heads_sinks_replicated": lambda: _check(
            mesh, ([S2], [S2], [S2]), nq=4 * m, nkv=2 * m, sinks=[R]
        ),
        "dp_sinks_replicated": lambda: _check(
            mesh, ([S0], [S0], [S0]), b=3, sinks=[R], mask_mode=3
        ),
        "cp_causal_gathered_s9": lambda: _check(mesh, ([S1], [S1], [S1]), mask_mode=3),
        "cp_causal_replicated_kv": lambda: _check(
            mesh, ([S1], [R], [R]), mask_mode=3, s1=11, s2=11
        ),
        "cp_causal_more_keys": lambda: _check(mesh, ([S1], [R], [R]), mask_mode=3, s1=9, s2=20),
        "cp_no_mask_more_keys_gathered": lambda: _check(mesh, ([S1], [S1], [S1]), s1=7, s2=13),
        # Query heads split over more ranks than there are key heads: k and v replicated.
        "tp_fewer_kv_heads_8_over_2": lambda: _check(
            mesh, ([S2], [R], [R]), nq=8, nkv=2, mask_mode=3, sinks=[R]
        ),
        "tp_fewer_kv_heads_one_kv_head": lambda: _check(
            mesh, ([S2], [R], [R]), b=3, nq=6, nkv=1, layout="BNSD"
        ),
        "tp_kv_replicated_mha_tnd": lambda: _check_tnd(
            mesh, [9, 0, 13], [9, 4, 20], ([S1], [R], [R]), nq=5, nkv=5, mask_mode=3
        ),
        # Ulysses: all-to-all into head-sharded full sequences and back.
        "ulysses_causal_s9_sinks": lambda: _check(
            mesh,
            ([S1], [S1], [S1]),
            mask_mode=3,
            nq=4 * m,
            nkv=2 * m,
            sinks=[R],
            context_parallel="ulysses",
        ),  # fmt: skip
        "ulysses_gqa_one_kv_head": lambda: _check(
            mesh,
            ([S1], [S1], [S1]),
            mask_mode=3,
            b=1,
            s1=11,
            s2=11,
            nq=8,
            nkv=1,
            context_parallel="ulysses",
        ),  # fmt: skip
        "ulysses_uneven_heads_window_bnsd": lambda: _check(
            mesh,
            ([S2], [S2], [S2]),
            layout="BNSD",
            mask_mode=4,
            win_left=3,
            win_right=2,
            s1=10,
            s2=13,
            nq=6,
            nkv=2,
            context_parallel="ulysses",
        ),  # fmt: skip
        "ulysses_tnd_varlen": lambda: _check_tnd(
            mesh,
            [9, 0, 23, 17],
            [9, 4, 40, 17],
            ([S0], [S0], [S0]),
            nq=2 * m,
            nkv=m,
            sinks=[R],
            mask_mode=3,
            context_parallel="ulysses",
        ),  # fmt: skip
        "ulysses_head_tail": lambda: _check_head_tail(
            mesh, "hyperparallel", True, b=2, nq=2 * m, nkv=2, context_parallel="ulysses"
        ),
        "ulysses_tnd_head_tail": lambda: _check_tnd_head_tail(
            mesh,
            "opmesh",
            [4 * m, 0, 2 * m],
            [4 * m, 2 * m, 6 * m],
            True,
            nq=4,
            nkv=2,
            mask_mode=3,
            context_parallel="ulysses",
        ),  # fmt: skip
        "ulysses_errors": lambda: case_ulysses_errors(mesh),
        "cp_sliding_window": lambda: _check(
            mesh, ([S1], [S1], [S1]), mask_mode=4, win_left=3, win_right=0, s1=17, s2=17
        ),
        "cp_window_both_sides": lambda: _check(
            mesh, ([S1], [S1], [S1]), mask_mode=4, win_left=3, win_right=2, s1=17, s2=17
        ),
        "cp_window_right_only_more_keys": lambda: _check(
            mesh, ([S1], [R], [R]), mask_mode=4, win_left=-1, win_right=4, s1=13, s2=19
        ),
        "cp_window_more_queries": lambda: _check(
            mesh, ([S1], [S1], [S1]), mask_mode=4, win_left=2, win_right=3, s1=20, s2=9
        ),
        "cp_sinks": lambda: _check(mesh, ([S1], [S1], [S1]), mask_mode=3, sinks=[R], s1=10, s2=10),
        "cp_bnsd": lambda: _check(
            mesh, ([S2], [S2], [S2]), mask_mode=3, layout="BNSD", s1=10, s2=10
        ),
        "ring_causal_uneven_s9": lambda: _check(
            mesh, ([S1], [S1], [S1]), mask_mode=3, context_parallel="ring"
        ),
        "ring_causal_s17_sinks": lambda: _check(
            mesh, ([S1], [S1], [S1]), mask_mode=3, s1=17, s2=17, sinks=[R], context_parallel="ring"
        ),
        "ring_no_mask_more_keys": lambda: _check(
            mesh, ([S1], [S1], [S1]), s1=7, s2=13, context_parallel="ring"
        ),
        "ring_bnsd_gqa": lambda: _check(
            mesh,
            ([S2], [S2], [S2]),
            mask_mode=3,
            layout="BNSD",
            s1=12,
            s2=12,
            nq=8,
            context_parallel="ring",
        ),  # fmt: skip
        "ring_dp_and_tiny_shards": lambda: _check(
            mesh, ([S1], [S1], [S1]), mask_mode=3, b=3, s1=2, s2=2, context_parallel="ring"
        ),
        "ring_equals_all_gather": lambda: case_ring_equals_all_gather(mesh),
        "dp_local_plans": lambda: case_local_plans(mesh),
        "tnd_cp_causal_varlen": lambda: _check_tnd(
            mesh, [5, 0, 13, 1, 9], [5, 3, 13, 0, 12], ([S0], [R], [R]), mask_mode=3
        ),
        "tnd_cp_gathered_no_mask": lambda: _check_tnd(
            mesh, [7, 11, 2], [4, 15, 6], ([S0], [S0], [S0])
        ),
        "tnd_cp_gathered_window": lambda: _check_tnd(
            mesh,
            [20, 3, 17],
            [20, 3, 17],
            ([S0], [S0], [S0]),
            mask_mode=4,
            win_left=4,
            win_right=0,
        ),  # fmt: skip
        "tnd_tp_heads": lambda: _check_tnd(
            mesh, [6, 9], [8, 9], ([S1], [S1], [S1]), nq=2 * m, nkv=m, mask_mode=3
        ),
        "head_tail_opmesh_gathered": lambda: _check_head_tail(mesh, "opmesh", True),
        "head_tail_hyperparallel_gathered": lambda: _check_head_tail(mesh, "hyperparallel", True),
        "head_tail_hyperparallel_replicated_kv": lambda: _check_head_tail(
            mesh, "hyperparallel", False, b=2
        ),
        "head_tail_sliding_window": lambda: _check_head_tail(
            mesh, "opmesh", True, mask_mode=4, win_left=5, win_right=0
        ),
        "head_tail_window_both_sides": lambda: _check_head_tail(
            mesh, "hyperparallel", True, mask_mode=4, win_left=4, win_right=3
        ),
        "head_tail_process_switch": lambda: case_process_switch(mesh),
        "tnd_head_tail_opmesh_gathered": lambda: _check_tnd_head_tail(
            mesh,
            "opmesh",
            [4 * m, 0, 6 * m, 2 * m],
            [4 * m, 2 * m, 6 * m, 4 * m],
            True,
            mask_mode=3,
        ),  # fmt: skip
        "tnd_head_tail_hyperparallel_gathered": lambda: _check_tnd_head_tail(
            mesh, "hyperparallel", [8 * m, 2 * m, 0], [8 * m, 4 * m, 2 * m], True, mask_mode=3
        ),
        "tnd_head_tail_replicated_kv_more_keys": lambda: _check_tnd_head_tail(
            mesh, "hyperparallel", [2 * m, 6 * m], [5, 6 * m + 3], False, mask_mode=3
        ),
        "tnd_head_tail_window": lambda: _check_tnd_head_tail(
            mesh,
            "opmesh",
            [6 * m, 4 * m],
            [6 * m, 4 * m],
            True,
            mask_mode=4,
            win_left=3,
            win_right=0,
        ),  # fmt: skip
        "tnd_head_tail_no_mask": lambda: _check_tnd_head_tail(
            mesh, "opmesh", [2 * m, 4 * m], [6 * m, 2 * m], True
        ),
        "tnd_dp_whole_sequences_causal": lambda: case_tnd_data_parallel(mesh, mask_mode=3),
        "tnd_dp_whole_sequences_window": lambda: case_tnd_data_parallel(
            mesh, mask_mode=4, win_left=2, win_right=3
        ),
        "errors": lambda: case_errors(mesh),
        # softcap (every strategy) and ALiBi slopes cut to each rank's heads and batch entries.
        "mods_dp_batch_slopes": lambda: _check(
            mesh, ([S0], [S0], [S0]), b=3, mask_mode=3, softcap=1.5, alibi_slopes=_slopes(3, 4)
        ),
        "mods_tp_heads": lambda: _check(
            mesh,
            ([S2], [S2], [S2]),
            nq=2 * m,
            nkv=m,
            softcap=1.5,
            alibi_slopes=_slopes(None, 2 * m),
        ),  # fmt: skip
        "mods_tp_fewer_kv_heads": lambda: _check(
            mesh, ([S2], [R], [R]), nq=8, nkv=2, mask_mode=3, alibi_slopes=_slopes(2, 8)
        ),
        "mods_cp_causal_more_keys": lambda: _check(
            mesh,
            ([S1], [S1], [S1]),
            mask_mode=3,
            s1=9,
            s2=13,
            softcap=1.5,
            alibi_slopes=_slopes(2, 4),
        ),  # fmt: skip
        "mods_cp_head_tail": lambda: _check_head_tail(
            mesh, "opmesh", True, softcap=1.5, alibi_slopes=_slopes(None, 4)
        ),
        "mods_ulysses_window": lambda: _check(
            mesh,
            ([S1], [S1], [S1]),
            mask_mode=4,
            win_left=2,
            win_right=1,
            nq=4 * m,
            nkv=2 * m,
            context_parallel="ulysses",
            softcap=1.5,
            alibi_slopes=_slopes(2, 4 * m),
        ),  # fmt: skip
        "mods_ring_softcap": lambda: _check(
            mesh,
            ([S1], [S1], [S1]),
            mask_mode=3,
            s1=11,
            s2=11,
            softcap=1.5,
            context_parallel="ring",
        ),  # fmt: skip
        "mods_tnd_cp_causal": lambda: _check_tnd(
            mesh,
            [9, 0, 13],
            [9, 4, 20],
            ([S0], [S0], [S0]),
            mask_mode=3,
            softcap=1.5,
            alibi_slopes=_slopes(3, 4),
        ),  # fmt: skip
        "mods_tnd_dp": lambda: case_score_mods_tnd_dp(mesh),
        "mods_errors": lambda: case_score_mods_errors(mesh),
        # Shards that are empty on some ranks: each such rank computes its empty part.
        "empty_shards_heads_2": lambda: _check(mesh, ([S2], [S2], [S2]), nq=2, nkv=2, mask_mode=3),
        "empty_shards_heads_sinks": lambda: _check(
            mesh, ([S2], [S2], [S2]), nq=2, nkv=2, sinks=[S0]
        ),
        "empty_shards_batch_1": lambda: _check(mesh, ([S0], [S0], [S0]), b=1, sinks=[R]),
        "empty_shards_sequence_1": lambda: _check(
            mesh, ([S1], [S1], [S1]), s1=1, s2=1, mask_mode=3
        ),
        "empty_shards_sequence_1_ring": lambda: _check(
            mesh, ([S1], [S1], [S1]), s1=1, s2=1, mask_mode=3, context_parallel="ring"
        ),
        "empty_shards_no_keys": lambda: _check(mesh, ([S0], [S0], [S0]), b=3, s2=0),
        "empty_shards_tnd_tokens_1": lambda: _check_tnd(mesh, [1, 0], [1, 2], ([S0], [R], [R])),
        "empty_shards_tnd_heads_1": lambda: _check_tnd(
            mesh, [3, 4], [3, 4], ([S1], [S1], [S1]), nq=1, nkv=1, mask_mode=3
        ),
    }


def case_local_plans(mesh):
    """Without context parallel, each rank passes its plan of its local problem."""
    q, k, v = _inputs(5, 33, 33, 4, 2)
    want, _ = opmesh.flash_attn(q, k, v, mask_mode=3)
    S0 = [Shard(0)]
    dq, dk, dv = (opmesh.distribute_tensor(x, mesh, S0) for x in (q, k, v))
    local_batch = dq.to_local().shape[0]
    plan = opmesh.flash_attn_metadata(
        4, 2, 16, batch_size=local_batch, max_seqlen_q=33, max_seqlen_kv=33, mask_mode=3,
        num_workers=3,
    )  # fmt: skip
    got, _ = opmesh.flash_attn(dq, dk, dv, mask_mode=3, metadata=plan)
    _close(got, want, "out")
    wrong = opmesh.flash_attn_metadata(
        4, 2, 16, batch_size=5, max_seqlen_q=33, max_seqlen_kv=33, mask_mode=3
    )
    if local_batch != 5:
        _expect(
            ValueError,
            "metadata:",
            lambda: opmesh.flash_attn(dq, dk, dv, mask_mode=3, metadata=wrong),
        )


def case_ring_equals_all_gather(mesh):
    q, k, v = _inputs(2, 21, 21, 4, 2)
    S1 = [Shard(1)]
    dq, dk, dv = (opmesh.distribute_tensor(x, mesh, S1) for x in (q, k, v))
    ring = opmesh.flash_attn(
        dq, dk, dv, mask_mode=3, return_softmax_lse=True, context_parallel="ring"
    )
    gathered = opmesh.flash_attn(dq, dk, dv, mask_mode=3, return_softmax_lse=True)
    for a, b in zip(ring, gathered, strict=True):
        assert a.placements == b.placements
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6)


def case_process_switch(mesh):
    """set_head_tail_cp turns the order on for the process; a block's order wins inside it."""
    from opmesh.distributed.context_parallel import head_tail_order

    opmesh.set_head_tail_cp("hyperparallel")
    try:
        assert head_tail_order() == "hyperparallel"
        with opmesh.head_tail_cp("opmesh"):
            assert head_tail_order() == "opmesh"
        assert head_tail_order() == "hyperparallel"
        cp = mesh.size(0)
        q, k, v = _inputs(1, 4 * cp, 4 * cp, 4, 2)
        want, _ = opmesh.flash_attn(q, k, v, mask_mode=3)
        dq = opmesh.distribute_tensor(
            opmesh.to_head_tail(q, 1, cp, order="hyperparallel"), mesh, [Shard(1)]
        )
        got, _ = opmesh.flash_attn(
            dq,
            opmesh.distribute_tensor(k, mesh, [R]),
            opmesh.distribute_tensor(v, mesh, [R]),
            mask_mode=3,
        )
        _close(opmesh.from_head_tail(got.full_tensor(), 1, cp, order="hyperparallel"), want, "out")
    finally:
        opmesh.set_head_tail_cp(None)
    assert head_tail_order() is None
    _expect(ValueError, "order: expected", lambda: opmesh.set_head_tail_cp("zigzag"))


CASE_NAMES = [
    "replicated",
    "dp_uneven_batch_3",
    "tp_heads",
    "tp_heads_sinks_sharded",
    "tp_heads_sinks_replicated",
    "dp_sinks_replicated",
    "cp_causal_gathered_s9",
    "cp_causal_replicated_kv",
    "cp_causal_more_keys",
    "cp_no_mask_more_keys_gathered",
    "tp_fewer_kv_heads_8_over_2",
    "tp_fewer_kv_heads_one_kv_head",
    "tp_kv_replicated_mha_tnd",
    "ulysses_causal_s9_sinks",
    "ulysses_gqa_one_kv_head",
    "ulysses_uneven_heads_window_bnsd",
    "ulysses_tnd_varlen",
    "ulysses_head_tail",
    "ulysses_tnd_head_tail",
    "ulysses_errors",
    "cp_sliding_window",
    "cp_window_both_sides",
    "cp_window_right_only_more_keys",
    "cp_window_more_queries",
    "cp_sinks",
    "cp_bnsd",
    "ring_causal_uneven_s9",
    "ring_causal_s17_sinks",
    "ring_no_mask_more_keys",
    "ring_bnsd_gqa",
    "ring_dp_and_tiny_shards",
    "ring_equals_all_gather",
    "dp_local_plans",
    "tnd_cp_causal_varlen",
    "tnd_cp_gathered_no_mask",
    "tnd_cp_gathered_window",
    "tnd_tp_heads",
    "head_tail_opmesh_gathered",
    "head_tail_hyperparallel_gathered",
    "head_tail_hyperparallel_replicated_kv",
    "head_tail_sliding_window",
    "head_tail_window_both_sides",
    "head_tail_process_switch",
    "tnd_head_tail_opmesh_gathered",
    "tnd_head_tail_hyperparallel_gathered",
    "tnd_head_tail_replicated_kv_more_keys",
    "tnd_head_tail_window",
    "tnd_head_tail_no_mask",
    "tnd_dp_whole_sequences_causal",
    "tnd_dp_whole_sequences_window",
    "errors",
    "mods_dp_batch_slopes",
    "mods_tp_heads",
    "mods_tp_fewer_kv_heads",
    "mods_cp_causal_more_keys",
    "mods_cp_head_tail",
    "mods_ulysses_window",
    "mods_ring_softcap",
    "mods_tnd_cp_causal",
    "mods_tnd_dp",
    "mods_errors",
    "empty_shards_heads_2",
    "empty_shards_heads_sinks",
    "empty_shards_batch_1",
    "empty_shards_sequence_1",
    "empty_shards_sequence_1_ring",
    "empty_shards_no_keys",
    "empty_shards_tnd_tokens_1",
    "empty_shards_tnd_heads_1",
]


def case_ulysses_errors(mesh):
    """Ulysses needs k and v sharded like q, and heads it can split."""
    q, k, v = _inputs(1, 8, 8, 4, 2)
    S1 = [Shard(1)]
    dq, dk, dv = (opmesh.distribute_tensor(x, mesh, S1) for x in (q, k, v))
    rk = opmesh.distribute_tensor(k, mesh, [R])
    _expect(
        ValueError,
        "k: dim 1 is sharded over mesh axes none; Ulysses needs the key sequence sharded as q's",
        lambda: opmesh.flash_attn(dq, rk, dv, context_parallel="ulysses"),
    )
    _expect(
        ValueError,
        "context_parallel: expected 'all_gather', 'ring', 'ulysses'",
        lambda: opmesh.flash_attn(dq, dk, dv, context_parallel=("ring", "ulysses")),
    )
    _expect(
        ValueError,
        f"q: dim 1 is sharded over mesh axes '{mesh.mesh_dim_names[0]}'; "
        "context_parallel=('ulysses', 'ring') needs",
        lambda: opmesh.flash_attn(dq, dk, dv, context_parallel=("ulysses", "ring")),
    )


def two_axis_cases(mesh):
    """A (dp, cp) mesh: batch over the first axis, sequence (or heads) over the second."""
    S0, S1, S2 = Shard(0), Shard(1), Shard(2)
    t = mesh.size(1)
    return {
        "2d_dp_cp_all_gather": lambda: _check(
            mesh, ([S0, S1], [S0, S1], [S0, S1]), b=3, s1=11, s2=11, mask_mode=3, sinks=[R, R]
        ),
        "2d_dp_cp_ring": lambda: _check(
            mesh,
            ([S0, S1], [S0, S1], [S0, S1]),
            b=3,
            s1=11,
            s2=11,
            mask_mode=3,
            context_parallel="ring",
        ),  # fmt: skip
        "2d_dp_tp": lambda: _check(
            mesh, ([S0, S2], [S0, S2], [S0, S2]), b=3, nq=2 * t, nkv=t, mask_mode=3
        ),
        "2d_cp_replicated_kv_dp": lambda: _check(
            mesh, ([S0, S1], [S0, R], [S0, R]), b=2, s1=9, s2=14, mask_mode=3
        ),
        "2d_cp_window_dp": lambda: _check(
            mesh,
            ([S0, S1], [S0, S1], [S0, S1]),
            b=3,
            s1=13,
            s2=13,
            mask_mode=4,
            win_left=3,
            win_right=2,
        ),  # fmt: skip
        "2d_tnd_dp_tp": lambda: case_tnd_data_parallel(mesh, mask_mode=3),
        "2d_tp_fewer_kv_heads_cp": lambda: _check(
            mesh, ([S2, S1], [R, S1], [R, S1]), b=2, s1=11, s2=11, nq=4, nkv=1, mask_mode=3
        ),
        "2d_tp_fewer_kv_heads_ring": lambda: _check(
            mesh,
            ([S2, S1], [R, S1], [R, S1]),
            b=1,
            s1=10,
            s2=10,
            nq=6,
            nkv=2,
            mask_mode=3,
            context_parallel="ring",
        ),  # fmt: skip
        "2d_dp_ulysses": lambda: _check(
            mesh,
            ([S0, S1], [S0, S1], [S0, S1]),
            b=3,
            s1=11,
            s2=11,
            nq=8,
            nkv=2,
            mask_mode=3,
            sinks=[R, R],
            context_parallel="ulysses",
        ),  # fmt: skip
        "2d_dp_ulysses_score_mods": lambda: _check(
            mesh,
            ([S0, S1], [S0, S1], [S0, S1]),
            b=3,
            s1=11,
            s2=11,
            nq=8,
            nkv=2,
            mask_mode=3,
            softcap=1.5,
            alibi_slopes=_slopes(3, 8),
            context_parallel="ulysses",
        ),  # fmt: skip
        "2d_dp_tp_score_mods": lambda: _check(
            mesh,
            ([S0, S2], [S0, S2], [S0, S2]),
            b=3,
            nq=8,
            nkv=4,
            softcap=1.5,
            alibi_slopes=_slopes(3, 8),
        ),  # fmt: skip
        "2d_ulysses_ring": lambda: _check(
            mesh,
            ([S1, S1], [S1, S1], [S1, S1]),
            b=2,
            s1=13,
            s2=13,
            nq=8,
            nkv=2,
            mask_mode=3,
            context_parallel=("ulysses", "ring"),
        ),  # fmt: skip
        "2d_ulysses_all_gather_window": lambda: _check(
            mesh,
            ([S1, S1], [S1, S1], [S1, S1]),
            b=1,
            s1=14,
            s2=17,
            nq=4,
            nkv=1,
            mask_mode=4,
            win_left=3,
            win_right=2,
            context_parallel=("ulysses", "all_gather"),
        ),  # fmt: skip
        # One head over the heads axis and one sequence over the batch axis: empty shards on
        # both axes.
        "2d_empty_shards_one_head": lambda: _check(
            mesh, ([S0, S2], [S0, S2], [S0, S2]), b=1, nq=1, nkv=1, mask_mode=3
        ),
    }


TWO_AXIS_CASE_NAMES = [
    "2d_dp_cp_all_gather",
    "2d_dp_cp_ring",
    "2d_dp_tp",
    "2d_cp_replicated_kv_dp",
    "2d_cp_window_dp",
    "2d_tnd_dp_tp",
    "2d_tp_fewer_kv_heads_cp",
    "2d_tp_fewer_kv_heads_ring",
    "2d_dp_ulysses",
    "2d_dp_ulysses_score_mods",
    "2d_dp_tp_score_mods",
    "2d_ulysses_ring",
    "2d_ulysses_all_gather_window",
    "2d_empty_shards_one_head",
]


def mesh_cases(mesh):
    """The cases written for this mesh's number of axes (mesh_runner.py runs them), and the raw
    operator cases on every mesh."""
    chosen = two_axis_cases(mesh) if mesh.ndim == 2 else cases(mesh)
    for name, kw in RAW_CASES.items():
        chosen[name] = lambda kw=kw: case_raw_ops(mesh, **kw)
    chosen["raw_tnd_heads"] = lambda: case_raw_tnd_heads(mesh)
    return chosen


def case_raw_ops(mesh, layout="BSND", by="batch"):
    """torch.ops.opmesh.flash_attn (and, through its autograd, flash_attn_backward) called
    directly with DTensors sharded by batch or heads: DTensor runs them by their registered
    strategies, with the outputs and gradients of the one-device call and of opmesh.flash_attn."""
    m = mesh.size()
    nq, nkv = (4 * m, 2 * m) if by == "heads" else (4, 2)
    b = 2 * m + 1 if by == "batch" else 2  # batch sizes that do not divide the mesh
    q, k, v = _inputs(b, 9, 11, nq, nkv, layout=layout)
    dim = {"batch": 0, "heads": 2 if layout == "BSND" else 1}[by]
    sinks = torch.linspace(-1.0, 1.0, nq)
    options = dict(mask_mode=3, layout_q=layout, layout_kv=layout, layout_out=layout)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = opmesh.flash_attn(*leaves[:3], sinks=leaves[3], return_softmax_lse=True, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * dout).sum().backward()
    place = [Shard(dim)] * mesh.ndim
    sink_place = [Shard(0) if by == "heads" else R] * mesh.ndim
    if mesh.ndim == 2 and by == "heads":  # data parallel over the first axis, heads the second
        place, sink_place = [Shard(0), Shard(dim)], [R, Shard(0)]
    dist = [opmesh.distribute_tensor(x.detach(), mesh, place).requires_grad_() for x in (q, k, v)]
    dsinks = opmesh.distribute_tensor(sinks, mesh, sink_place).requires_grad_()
    got, got_lse = torch.ops.opmesh.flash_attn(
        *dist, sinks=dsinks, return_softmax_lse=True, **options
    )
    assert tuple(got.placements) == tuple(place), f"out placements {got.placements}"
    via_dfunction, _ = opmesh.flash_attn(
        *(x.detach() for x in dist), sinks=dsinks.detach(), **options
    )
    assert torch.equal(got.full_tensor(), via_dfunction.full_tensor()), "raw op != DFunction"
    (got * opmesh.distribute_tensor(dout, mesh, got.placements)).sum().backward()
    _close(got, out.detach(), "out")
    _close(got_lse, lse.detach(), "lse")
    for name, x, leaf in zip(("dq", "dk", "dv", "dsinks"), (*dist, dsinks), leaves, strict=True):
        _close(x.grad, leaf.grad, name)
    if by == "batch":
        # Each rank runs whole sequences with a deterministic kernel: the same bits as one
        # device (sinks' gradient, a sum over ranks, excepted).
        grads = [(x.grad, y.grad) for x, y in zip(dist, leaves[:3], strict=True)]
        pairs = [(got, out), (got_lse, lse), *grads]
        for i, (a, b_) in enumerate(pairs):
            assert torch.equal(a.full_tensor(), b_.detach()), f"output {i} not bitwise equal"
    # merge_attn_states on DTensors: attention to two halves of the keys, merged, equals
    # attention to all of them.
    seq = 1 if layout == "BSND" else 2
    options = dict(return_softmax_lse=True, layout_q=layout, layout_kv=layout, layout_out=layout)
    q_, k_, v_ = (x.detach() for x in dist)
    a = torch.ops.opmesh.flash_attn(q_, k_.narrow(seq, 0, 5), v_.narrow(seq, 0, 5), **options)
    b_ = torch.ops.opmesh.flash_attn(q_, k_.narrow(seq, 5, 6), v_.narrow(seq, 5, 6), **options)
    merged, merged_lse = torch.ops.opmesh.merge_attn_states(*a, *b_, layout=layout)
    whole, whole_lse = opmesh.flash_attn(q, k, v, **options)
    assert tuple(merged.placements) == tuple(place), f"merged placements {merged.placements}"
    _close(merged, whole, "merged out")
    _close(merged_lse, whole_lse, "merged lse")


RAW_CASES = {
    "raw_bsnd_batch": dict(layout="BSND", by="batch"),
    "raw_bsnd_heads": dict(layout="BSND", by="heads"),
    "raw_bnsd_batch": dict(layout="BNSD", by="batch"),
    "raw_bnsd_heads": dict(layout="BNSD", by="heads"),
}


def case_raw_tnd_heads(mesh):
    """torch.ops.opmesh.flash_attn in TND with the heads sharded and the lengths as replicated
    DTensors: the one-device result, and gradients through the raw operator's autograd."""
    m = mesh.size()
    q_lens, k_lens = [5, 0, 9], [7, 3, 9]
    g = torch.Generator().manual_seed(6)
    q = torch.randn(sum(q_lens), 4 * m, 16, generator=g)
    k = torch.randn(sum(k_lens), 2 * m, 16, generator=g)
    v = torch.randn(sum(k_lens), 2 * m, 16, generator=g)

    tnd = dict(layout_q="TND", layout_kv="TND", layout_out="TND", mask_mode=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want, want_lse = torch.ops.opmesh.flash_attn(
        *leaves, cu_seqlens_q=_cu(q_lens), cu_seqlens_kv=_cu(k_lens), return_softmax_lse=True, **tnd
    )
    dout = torch.randn(want.shape, generator=g)
    (want * dout).sum().backward()
    heads = [Shard(1)] * mesh.ndim
    dist = [opmesh.distribute_tensor(x, mesh, heads).requires_grad_() for x in (q, k, v)]
    lengths = {
        name: opmesh.distribute_tensor(_cu(lens), mesh, [R] * mesh.ndim)
        for name, lens in (("cu_seqlens_q", q_lens), ("cu_seqlens_kv", k_lens))
    }
    got, got_lse = torch.ops.opmesh.flash_attn(*dist, return_softmax_lse=True, **lengths, **tnd)
    assert tuple(got.placements) == tuple(heads), f"out placements {got.placements}"
    assert tuple(got_lse.placements) == (Shard(0),) * mesh.ndim, f"lse {got_lse.placements}"
    (got * opmesh.distribute_tensor(dout, mesh, got.placements)).sum().backward()
    _close(got, want.detach(), "out")
    _close(got_lse, want_lse.detach(), "lse")
    for name, x, leaf in zip(("dq", "dk", "dv"), dist, leaves, strict=True):
        _close(x.grad, leaf.grad, name)


RAW_CASE_NAMES = [*RAW_CASES, "raw_tnd_heads"]
