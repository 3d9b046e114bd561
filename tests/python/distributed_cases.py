"""Cases run on real process groups (gloo, spawned processes) by test_distributed.py.

Each case takes the device mesh and raises on failure. Results are compared with the
single-device call on the same inputs, which every rank computes itself.
"""

from __future__ import annotations

import torch
from mesh_runner import expect_error as _expect
from torch.distributed.tensor import DTensor

import opmesh
from opmesh import DFunction, DistributedOp, Layout, Partial, Replicate, Shard


def _inputs(layout, b=2, s1=32, s2=32, n1=8, n2=2, d=16, lengths=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "BSND":
        q = torch.randn(b, s1, n1, d, generator=g)
        k = torch.randn(b, s2, n2, d, generator=g)
        w = torch.randn(b, s1, n1, generator=g) / 8
        return q, k, w, {}
    q_lens, k_lens = lengths
    q = torch.randn(sum(q_lens), n1, d, generator=g)
    k = torch.randn(sum(k_lens), n2, d, generator=g)
    w = torch.randn(sum(q_lens), n1, generator=g) / 8
    kw = dict(
        actual_seq_qlen=torch.tensor(q_lens).cumsum(0),
        actual_seq_klen=torch.tensor(k_lens).cumsum(0),
        layout="TND",
    )
    return q, k, w, kw


def _close(got, want, what):
    if isinstance(got, DTensor):
        assert got.shape == want.shape, f"{what}: global shape {tuple(got.shape)} on this rank"
    got_full = got.full_tensor() if hasattr(got, "full_tensor") else got
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got_full), finite), f"{what}: infinities differ"
    err = ((got_full - want).abs() / want.abs().clamp_min(1e-6))[finite]
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= 1e-6, f"{what}: relative error {worst:.2e} > 1e-6"


def _check(mesh, layout, placements, sparse_mode=3, head_tail=False, **shape):
    q, k, w, kw = _inputs(layout, **shape)
    want = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, sparse_mode=sparse_mode, **kw)
    cp = mesh.size(mesh.ndim - 1)
    if head_tail:
        q, w = opmesh.to_head_tail(q, 1, cp), opmesh.to_head_tail(w, 1, cp)
    qp, kp, wp = placements
    dq = opmesh.distribute_tensor(q, mesh, qp)
    dk = opmesh.distribute_tensor(k, mesh, kp)
    dw = opmesh.distribute_tensor(w, mesh, wp)
    if head_tail:
        with opmesh.head_tail_cp():
            got = opmesh.dense_lightning_indexer_softmax_lse(
                dq, dk, dw, sparse_mode=sparse_mode, **kw
            )
        got = tuple(opmesh.from_head_tail(g.full_tensor(), 2, cp) for g in got)
    else:
        got = opmesh.dense_lightning_indexer_softmax_lse(dq, dk, dw, sparse_mode=sparse_mode, **kw)
        for g in got:
            assert isinstance(g, DTensor), "outputs must be DTensors"
    _close(got[0], want[0], "softmax_max")
    _close(got[1], want[1], "softmax_sum")


R, S0, S1 = Replicate(), Shard(0), Shard(1)
VARLEN = ([9, 0, 23, 17, 15], [9, 4, 40, 17, 30])  # 64 query tokens, uneven sequences


# -- a user-defined op with a backward: row-wise RMS normalisation ---------------------------


class RowRmsNorm(DFunction):
    """y = x / sqrt(mean(x^2, -1) + eps), rows independent: rows may be sharded, the last dim
    may not."""

    _op_name = "test_row_rms_norm"

    @staticmethod
    def forward(ctx, x, eps=1e-6):
        rms = torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        y = x / rms
        ctx.save_for_backward(y, rms)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, rms = ctx.saved_tensors
        return (grad - y * (grad * y).mean(-1, keepdim=True)) / rms, None


class RowRmsNormDistributed(DistributedOp):
    def __init__(self):
        super().__init__("test_row_rms_norm")

    def preprocess(self, args, kwargs):
        x = args[0]
        lay = Layout.of(x)
        if lay.tensor_map[-1]:
            raise ValueError(
                f"x: dim {lay.ndim - 1} is sharded over mesh axis "
                f"{lay.axes_text(lay.ndim - 1)}; rows must be whole"
            )
        if lay.partial_axes():
            raise ValueError("x: Partial placements are not supported")
        return (
            (opmesh.platform.current().to_local(x), *args[1:]),
            kwargs,
            (lay.mesh, lay.placements, lay.shape),
        )

    def infer_layout(self, cache_values):
        return (cache_values,), None


def case_user_op_backward(mesh, rows=8):
    if "test_row_rms_norm" not in opmesh.distributed.distributed_op._instances:
        RowRmsNormDistributed()
    x = torch.randn(rows, 6, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = RowRmsNorm.apply(x)
    (y * torch.arange(16.0)).sum().backward()
    dx = opmesh.distribute_tensor(x.detach(), mesh, [S0] + [R] * (mesh.ndim - 1))
    dx.requires_grad_(True)
    dy = RowRmsNorm.apply(dx)
    assert dy.placements == dx.placements
    weight = opmesh.distribute_tensor(torch.arange(16.0), mesh, [R] * mesh.ndim)
    (dy * weight).sum().backward()
    assert dx.grad.placements == dx.placements, f"gradient placements {dx.grad.placements}"
    torch.testing.assert_close(dy.full_tensor(), y.detach())
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad)
    bad = opmesh.distribute_tensor(x.detach(), mesh, [Shard(2)] + [R] * (mesh.ndim - 1))
    _expect(ValueError, "x: dim 2 is sharded", lambda: RowRmsNorm.apply(bad))


def case_errors(mesh):
    q, k, w, _ = _inputs("BSND")
    axes = [R] * mesh.ndim

    def dist3(qp, kp, wp):
        return (
            opmesh.distribute_tensor(q, mesh, qp),
            opmesh.distribute_tensor(k, mesh, kp),
            opmesh.distribute_tensor(w, mesh, wp),
        )

    op = opmesh.dense_lightning_indexer_softmax_lse
    last = mesh.ndim - 1
    name = mesh.mesh_dim_names[last]

    def on_last(p):
        return axes[:last] + [p]

    _expect(
        ValueError,
        f"query_index: dim 3 (D) is sharded over mesh axis '{name}'",
        lambda: op(*dist3(on_last(Shard(3)), axes, axes)),
    )
    _expect(
        ValueError,
        "query_index: dim 2 (N1)",
        lambda: op(*dist3(on_last(Shard(2)), axes, on_last(Shard(2)))),
    )
    _expect(
        ValueError, "key_index: dim 1 (S2) is sharded", lambda: op(*dist3(axes, on_last(S1), axes))
    )
    _expect(ValueError, "weights: dim 0 (B)", lambda: op(*dist3(on_last(S0), on_last(S0), axes)))
    _expect(ValueError, "weights: dim 1 (S1)", lambda: op(*dist3(on_last(S1), axes, axes)))
    _expect(
        ValueError,
        "key_index: Partial placement on mesh axis",
        lambda: op(*dist3(axes, on_last(Partial()), axes)),
    )
    tq, tk, tw, tkw = _inputs("TND", lengths=VARLEN)
    _expect(
        ValueError,
        "key_index: dim 0 (T2) is sharded",
        lambda: op(
            opmesh.distribute_tensor(tq, mesh, axes),
            opmesh.distribute_tensor(tk, mesh, on_last(S0)),
            opmesh.distribute_tensor(tw, mesh, axes),
            **tkw,
        ),
    )
    _expect(
        ValueError, "query_index: expected a DTensor", lambda: op(q, *dist3(axes, axes, axes)[1:])
    )

    class NoName(DFunction):
        @staticmethod
        def forward(ctx, x):
            return x

    class NoRule(DFunction):
        _op_name = "op_without_rule"

        @staticmethod
        def forward(ctx, x):
            return x

    dq = opmesh.distribute_tensor(q, mesh, axes)
    _expect(ValueError, f"{NoName.__qualname__}: DTensor arguments need", lambda: NoName.apply(dq))
    _expect(
        ValueError,
        "no DistributedOp is registered for op 'op_without_rule'",
        lambda: NoRule.apply(dq),
    )
    with opmesh.head_tail_cp():
        _expect(ValueError, "head_tail_cp", lambda: op(*dist3(axes, axes, axes)))


class NoGradCtxProbe(DFunction):
    """Records what forward's ctx offers when no input needs a gradient."""

    seen = {}

    @staticmethod
    def forward(ctx, x, scale=2.0):
        NoGradCtxProbe.seen = {
            "needs_input_grad": ctx.needs_input_grad,
            "has_save_for_forward": callable(getattr(ctx, "save_for_forward", None)),
        }
        ctx.save_for_backward(x)
        NoGradCtxProbe.seen["saved"] = len(ctx.saved_tensors)
        ctx.mark_non_differentiable()
        ctx.set_materialize_grads(False)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0, None


def case_no_grad_ctx(mesh):
    x = torch.ones(3)
    NoGradCtxProbe.apply(x)
    plain = dict(NoGradCtxProbe.seen)
    x.requires_grad_(True)
    NoGradCtxProbe.apply(x)
    with_grad = dict(NoGradCtxProbe.seen)
    assert plain["needs_input_grad"] == (False, False), plain
    assert with_grad["needs_input_grad"] == (True, False), with_grad
    assert plain["has_save_for_forward"] and plain["saved"] == 1, plain


def case_lengths_as_dtensors(mesh):
    """Length arrays passed as replicated DTensors are read whole on every rank; a sharded one is
    refused by name."""
    q, k, w, kw = _inputs("TND", lengths=UNEVEN_VARLEN)
    want = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kw)
    rep = [R] * mesh.ndim
    shard = [R] * (mesh.ndim - 1) + [S0]
    got = opmesh.dense_lightning_indexer_softmax_lse(
        opmesh.distribute_tensor(q, mesh, shard),
        opmesh.distribute_tensor(k, mesh, rep),
        opmesh.distribute_tensor(w, mesh, shard),
        actual_seq_qlen=opmesh.distribute_tensor(kw["actual_seq_qlen"], mesh, rep),
        actual_seq_klen=opmesh.distribute_tensor(kw["actual_seq_klen"], mesh, rep),
        layout="TND",
    )
    _close(got[0], want[0], "softmax_max")
    _close(got[1], want[1], "softmax_sum")
    _expect(
        ValueError,
        "actual_seq_qlen:",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            opmesh.distribute_tensor(q, mesh, shard),
            opmesh.distribute_tensor(k, mesh, rep),
            opmesh.distribute_tensor(w, mesh, shard),
            actual_seq_qlen=opmesh.distribute_tensor(kw["actual_seq_qlen"], mesh, shard),
            actual_seq_klen=kw["actual_seq_klen"],
            layout="TND",
        ),
    )


def case_wrong_rank(mesh):
    q, k, w, _ = _inputs("BSND")
    rep = [R] * mesh.ndim
    op = opmesh.dense_lightning_indexer_softmax_lse
    dq = opmesh.distribute_tensor(q[0], mesh, rep)
    dk = opmesh.distribute_tensor(k, mesh, rep)
    dw = opmesh.distribute_tensor(w, mesh, rep)
    _expect(ValueError, "query_index: expected a 4-D DTensor", lambda: op(dq, dk, dw))
    dq = opmesh.distribute_tensor(q, mesh, rep)
    _expect(
        ValueError,
        "weights: expected a 2-D DTensor",
        lambda: op(dq[0], dk[0], dw, layout="TND", actual_seq_qlen=[16], actual_seq_klen=[16]),
    )


UNEVEN_VARLEN = ([3, 0, 5, 2], [3, 4, 5, 6])  # T1 = 10 query tokens


def _uneven_cases(mesh):
    """Sizes that do not divide the mesh: every rank's DTensor must carry the true global shape
    and full_tensor() must equal the one-device call."""
    rest = [R] * (mesh.ndim - 1)
    last = rest + [S0]
    dp = [S0] if mesh.ndim == 2 else []
    cases = {
        "uneven_batch_3": lambda: _check(mesh, "BSND", ([S0] + rest,) * 3, b=3, s1=8, s2=8),
        "uneven_batch_5": lambda: _check(mesh, "BSND", ([S0] + rest,) * 3, b=5, s1=8, s2=8),
        "uneven_batch_1": lambda: _check(mesh, "BSND", ([S0] + rest,) * 3, b=1, s1=8, s2=8),
        "uneven_cp_s1_9": lambda: _check(
            mesh, "BSND", (dp + [S1], dp + [R], dp + [S1]), b=3, s1=9, s2=9
        ),
        "uneven_cp_s1_9_more_keys": lambda: _check(
            mesh, "BSND", (dp + [S1], dp + [R], dp + [S1]), b=2, s1=9, s2=13
        ),
        "uneven_tnd_10": lambda: _check(
            mesh, "TND", (last, [R] * mesh.ndim, last), lengths=UNEVEN_VARLEN
        ),
        "uneven_tnd_10_mode0": lambda: _check(
            mesh, "TND", (last, [R] * mesh.ndim, last), sparse_mode=0, lengths=UNEVEN_VARLEN
        ),
        "uneven_user_op_rows_5": lambda: case_user_op_backward(mesh, rows=5),
        "lengths_as_dtensors": lambda: case_lengths_as_dtensors(mesh),
        "wrong_rank": lambda: case_wrong_rank(mesh),
        "no_grad_ctx": lambda: case_no_grad_ctx(mesh),
        # Shards empty on some ranks (one query row, one token, no keys).
        "empty_shards_cp_s1_1": lambda: _check(
            mesh, "BSND", (dp + [S1], dp + [R], dp + [S1]), b=2, s1=1, s2=5
        ),
        "empty_shards_no_keys": lambda: _check(mesh, "BSND", ([S0] + rest,) * 3, b=3, s1=4, s2=0),
        "empty_shards_tnd_1": lambda: _check(
            mesh, "TND", (last, [R] * mesh.ndim, last), lengths=([1, 0], [2, 3])
        ),
    }
    if mesh.ndim == 2:
        # One dim over both mesh axes: DTensor splits axis by axis, so T=10 on (2, 2) gives
        # rows [0, 3), [3, 5), [5, 8), [8, 10) and B=3 gives [0, 1), [1, 2), [2, 3), [].
        both = [S0, S0]
        cases["one_dim_two_axes_tnd_10"] = lambda: _check(
            mesh, "TND", (both, [R, R], both), lengths=UNEVEN_VARLEN
        )
        cases["one_dim_two_axes_batch_3"] = lambda: _check(
            mesh, "BSND", (both, both, both), b=3, s1=8, s2=8
        )
        cases["one_dim_two_axes_s1_9"] = lambda: _check(
            mesh, "BSND", ([S1, S1], [R, R], [S1, S1]), b=2, s1=9, s2=11
        )
    return cases


def _cp_cases(mesh):
    """Cases for a mesh whose last axis is the context-parallel one (and the first, if any,
    data parallel)."""
    dp = [S0] if mesh.ndim == 2 else []
    cases = {
        "replicated": lambda: _check(mesh, "BSND", ([R] * mesh.ndim,) * 3),
        "dp_only": lambda: _check(mesh, "BSND", ([S0] + [R] * (mesh.ndim - 1),) * 3, b=4),
        "cp_bsnd_square": lambda: _check(mesh, "BSND", (dp + [S1], dp + [R], dp + [S1]), b=2),
        "cp_bsnd_more_keys": lambda: _check(mesh, "BSND", (dp + [S1], dp + [R], dp + [S1]), s2=77),
        "cp_bsnd_sparse_mode0": lambda: _check(
            mesh, "BSND", (dp + [S1], dp + [R], dp + [S1]), sparse_mode=0, s2=50
        ),
        "cp_tnd_varlen": lambda: _check(
            mesh, "TND", ([S0] * mesh.ndim, [R] * mesh.ndim, [S0] * mesh.ndim), lengths=VARLEN
        ),
        "cp_tnd_sparse_mode0": lambda: _check(
            mesh,
            "TND",
            ([R] * (mesh.ndim - 1) + [S0], [R] * mesh.ndim, [R] * (mesh.ndim - 1) + [S0]),
            sparse_mode=0,
            lengths=VARLEN,
        ),
        "head_tail_bsnd": lambda: _check(
            mesh, "BSND", (dp + [S1], dp + [R], dp + [S1]), head_tail=True, s1=48, s2=60
        ),
        "user_op_backward": lambda: case_user_op_backward(mesh),
        "errors": lambda: case_errors(mesh),
    }
    cases.update(_uneven_cases(mesh))
    return cases


def cp_cases(mesh):
    """Every case for this mesh (mesh_runner.py runs them on each rank)."""
    return {**_cp_cases(mesh), **_kl_cases(mesh)}


CASE_NAMES = [
    "replicated",
    "dp_only",
    "cp_bsnd_square",
    "cp_bsnd_more_keys",
    "cp_bsnd_sparse_mode0",
    "cp_tnd_varlen",
    "cp_tnd_sparse_mode0",
    "head_tail_bsnd",
    "user_op_backward",
    "errors",
    "uneven_batch_3",
    "uneven_batch_5",
    "uneven_batch_1",
    "uneven_cp_s1_9",
    "uneven_cp_s1_9_more_keys",
    "uneven_tnd_10",
    "uneven_tnd_10_mode0",
    "uneven_user_op_rows_5",
    "lengths_as_dtensors",
    "wrong_rank",
    "no_grad_ctx",
    "empty_shards_cp_s1_1",
    "empty_shards_no_keys",
    "empty_shards_tnd_1",
]
TWO_AXIS_CASES = ["one_dim_two_axes_tnd_10", "one_dim_two_axes_batch_3", "one_dim_two_axes_s1_9"]


# -- the indexer's KL loss on a mesh ------------------------------------------------------------


def _kl_inputs(layout, b=3, s1=9, s2=11, lengths=None, seed=5):
    """The KL loss's inputs: the indexer's, and a main attention with 4 query / 2 key heads,
    a rope part, and statistics (any positive sums will do: the target is normalised)."""
    q, k, w, kw = _inputs(layout, b=b, s1=s1, s2=s2, n1=4, n2=1, d=16, lengths=lengths, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lead_q, lead_k = q.shape[:-2], k.shape[:-2]
    main = dict(
        query=torch.randn(*lead_q, 4, 8, generator=g),
        key=torch.randn(*lead_k, 2, 8, generator=g),
        query_rope=torch.randn(*lead_q, 4, 4, generator=g),
        key_rope=torch.randn(*lead_k, 2, 4, generator=g),
    )
    stats_shape = (2, lead_q[0], 2) if layout == "TND" else (b, 2, s1, 2)
    main["softmax_max"] = torch.randn(*stats_shape, generator=g)
    main["softmax_sum"] = torch.rand(*stats_shape, generator=g) + 0.5
    return dict(query_index=q, key_index=k, weights=w), main, kw


def _kl_placements(mesh, layout, cp):
    """Placements per tensor. With ``cp``: the query sequence over the last mesh axis, and in
    BSND the batch over the first axis of a 2-axis mesh. Without: the batch over every axis
    (BSND), nothing sharded (TND)."""
    rest = [R] * (mesh.ndim - 1)
    if layout == "TND":
        rows = rest + ([S0] if cp else [R])
        stats = rest + ([S1] if cp else [R])
        keys = [R] * mesh.ndim
    elif not cp:
        # Data parallel only: the batch over every mesh axis.
        rows = stats = keys = [S0] * mesh.ndim
    else:
        lead = [S0] if mesh.ndim == 2 else []
        rows = lead + [S1]
        stats = lead + [Shard(2)]
        keys = lead + [R]
    return dict(
        query_index=rows,
        weights=rows,
        query=rows,
        query_rope=rows,
        key_index=keys,
        key=keys,
        key_rope=keys,
        softmax_max=stats,
        softmax_sum=stats,
        softmax_max_index=stats,
        softmax_sum_index=stats,
    )


def _kl_close(got, want, what):
    got = got.full_tensor() if isinstance(got, DTensor) else got
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    scale = want.abs().max().item() + 1e-12
    worst = (got - want).abs().max().item() / scale
    assert worst <= 1e-5, f"{what}: error {worst:.2e} of the largest entry > 1e-5"


def case_kl_loss(mesh, layout="BSND", cp=True, head_tail=False, **options):
    """indexer_kl_loss and its gradients on the mesh equal the one-device call."""
    shape = options.pop("shape", {})
    index, main, kw = _kl_inputs(layout, **shape)
    kw.update(options)
    leaves = {n: x.clone().requires_grad_() for n, x in index.items()}
    loss = opmesh.indexer_kl_loss(*leaves.values(), **main, scale_value=0.3, **kw)
    loss.backward()
    placements = _kl_placements(mesh, layout, cp)
    cp_size = mesh.size(mesh.ndim - 1)
    if head_tail:
        for name in ("query_index", "weights", "query", "query_rope"):
            index_or_main = index if name in index else main
            index_or_main[name] = opmesh.to_head_tail(index_or_main[name], 1, cp_size)
        for name in ("softmax_max", "softmax_sum"):
            main[name] = opmesh.to_head_tail(main[name], 2, cp_size)
    dist = {
        n: opmesh.distribute_tensor(x, mesh, placements[n]) for n, x in {**index, **main}.items()
    }
    dleaves = {n: dist[n].requires_grad_() for n in index}
    dmain = {n: dist[n] for n in main}
    if head_tail:
        with opmesh.head_tail_cp():
            dloss = opmesh.indexer_kl_loss(*dleaves.values(), **dmain, scale_value=0.3, **kw)
    else:
        dloss = opmesh.indexer_kl_loss(*dleaves.values(), **dmain, scale_value=0.3, **kw)
    expect = [p for p in dloss.placements]
    row_axes = {mesh.ndim - 1} if cp else set()
    if layout == "BSND" and (mesh.ndim == 2 or not cp):
        row_axes |= set(range(mesh.ndim))
    for axis, placement in enumerate(expect):
        assert isinstance(placement, Partial) == (axis in row_axes), f"loss placements {expect}"
    _kl_close(dloss, loss.detach(), "loss")
    dloss.full_tensor().backward()
    for name, leaf in leaves.items():
        grad = dleaves[name].grad
        expect = tuple(dleaves[name].placements)
        if name == "key_index" and cp:  # a partial sum per rank, summed when read
            expect = expect[:-1] + (Partial(),)
        assert tuple(grad.placements) == expect, f"{name}.grad {grad.placements}"
        want = leaf.grad
        if head_tail and name != "key_index":
            want = opmesh.to_head_tail(want, 1, cp_size)
        _kl_close(grad, want, f"{name}.grad")


def case_kl_fused_op(mesh, layout="BSND", **shape):
    """dense_lightning_indexer_grad_kl_loss on DTensors: d_key_index comes back Partial over the
    context-parallel axis, and every output equals the one-device call."""
    index, main, kw = _kl_inputs(layout, **shape)
    stats = opmesh.dense_lightning_indexer_softmax_lse(*index.values(), **kw)
    names = ("softmax_max_index", "softmax_sum_index")
    tensors = {**index, **main, **dict(zip(names, stats, strict=True))}
    order = ("query", "key", "query_index", "key_index", "weights", "softmax_max", "softmax_sum")
    order += names
    rope = dict(query_rope=tensors["query_rope"], key_rope=tensors["key_rope"])
    want = opmesh.dense_lightning_indexer_grad_kl_loss(
        *(tensors[n] for n in order), 0.3, **rope, **kw
    )
    placements = _kl_placements(mesh, layout, cp=True)
    dist = {n: opmesh.distribute_tensor(x, mesh, placements[n]) for n, x in tensors.items()}
    drope = dict(query_rope=dist["query_rope"], key_rope=dist["key_rope"])
    got = opmesh.dense_lightning_indexer_grad_kl_loss(*(dist[n] for n in order), 0.3, **drope, **kw)
    assert isinstance(got[1].placements[-1], Partial), f"d_key_index {got[1].placements}"
    outputs = ("d_query_index", "d_key_index", "d_weights", "loss")
    for what, g, w in zip(outputs, got, want, strict=True):
        _kl_close(g, w, what)


def case_kl_errors(mesh):
    index, main, kw = _kl_inputs("BSND")
    placements = _kl_placements(mesh, "BSND", cp=True)
    last = mesh.ndim - 1
    name = mesh.mesh_dim_names[last]

    def call(**changes):
        p = dict(placements, **changes)
        dist = {n: opmesh.distribute_tensor(x, mesh, p[n]) for n, x in {**index, **main}.items()}
        args = [dist.pop(n) for n in ("query_index", "key_index", "weights")]
        return lambda: opmesh.indexer_kl_loss(*args, **dist, scale_value=0.3, **kw)

    axes = placements["key_index"][:last]
    _expect(
        ValueError,
        f"key_index: dim 2 (N2) is sharded over mesh axis '{name}'; it must be replicated",
        call(key_index=axes + [Shard(2)]),
    )
    _expect(
        ValueError,
        "softmax_max: dim 2 (S1) is not sharded; the query sequence must be sharded like",
        call(softmax_max=axes + [R]),
    )
    _expect(
        ValueError,
        f"query: dim 2 (N1) is sharded over mesh axis '{name}'; it must be replicated",
        call(query=axes + [Shard(2)]),
    )
    key = opmesh.distribute_tensor(main["key"], mesh, axes + [R])
    partial_key = DTensor.from_local(
        key.to_local(),
        mesh,
        axes + [Partial()],
        run_check=False,
        shape=key.shape,
        stride=key.stride(),
    )
    dist = {
        n: opmesh.distribute_tensor(x, mesh, placements[n]) for n, x in {**index, **main}.items()
    }
    args = [dist.pop(n) for n in ("query_index", "key_index", "weights")]
    _expect(
        ValueError,
        f"key: Partial placement on mesh axis '{name}'",
        lambda: opmesh.indexer_kl_loss(*args, **dict(dist, key=partial_key), **kw),
    )
    _expect(
        ValueError,
        "pre_tokens: a band with sparse_mode=0 cannot be split",
        lambda: opmesh.indexer_kl_loss(*args, **dist, sparse_mode=0, pre_tokens=3),
    )
    _expect(
        ValueError,
        "query: expected a DTensor like the other inputs",
        lambda: opmesh.indexer_kl_loss(*args, **dict(dist, query=main["query"])),
    )


# -- the default (element-wise) DistributedOp and the registry's op-name construction -----------


class ScaledProduct(DFunction):
    """x * y * 2 with the DistributedOp's defaults (element-wise)."""

    _op_name = "test_scaled_product"

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y * 2

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y * 2, grad * x * 2


class CountingWrap(DistributedOp):
    """The element-wise defaults, with the output-wrapping hook overridden to count calls."""

    wrapped = 0

    def wrap_outputs(self, outputs, out_layouts):
        CountingWrap.wrapped += 1
        return super().wrap_outputs(outputs, out_layouts)


def case_elementwise_default(mesh):
    from opmesh.distributed import distributed_op as registry

    if "test_scaled_product" not in registry._instances:
        CountingWrap("test_scaled_product")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 7, generator=g, requires_grad=True)
    y = torch.randn(5, 7, generator=g)
    (ScaledProduct.apply(x, y) * torch.arange(7.0)).sum().backward()
    placements = [S0] + [R] * (mesh.ndim - 1)
    dx = opmesh.distribute_tensor(x.detach(), mesh, placements).requires_grad_()
    dy = opmesh.distribute_tensor(y, mesh, placements)
    before = CountingWrap.wrapped
    out = ScaledProduct.apply(dx, dy)
    assert CountingWrap.wrapped == before + 1, "wrap_outputs was not called"
    assert tuple(out.placements) == tuple(placements), f"output placements {out.placements}"
    torch.testing.assert_close(out.full_tensor(), (x * y * 2).detach())
    weight = opmesh.distribute_tensor(torch.arange(7.0), mesh, [R] * mesh.ndim)
    (out * weight).sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad)
    other = opmesh.distribute_tensor(y, mesh, [R] * mesh.ndim)
    _expect(
        ValueError,
        "args[1]: an element-wise op needs every input laid out as args[0]",
        lambda: ScaledProduct.apply(dx.detach(), other),
    )
    partial = DTensor.from_local(torch.zeros(5, 7), mesh, [Partial()] * mesh.ndim)
    _expect(
        ValueError,
        f"args[0]: Partial placement on mesh axis '{mesh.mesh_dim_names[0]}'",
        lambda: ScaledProduct.apply(partial, partial),
    )


def _kl_cases(mesh):
    return {
        "kl_bsnd_cp": lambda: case_kl_loss(mesh),
        "kl_bsnd_dp_only": lambda: case_kl_loss(mesh, cp=False),
        "kl_bsnd_cp_mode0": lambda: case_kl_loss(mesh, sparse_mode=0),
        "kl_bsnd_cp_band": lambda: case_kl_loss(mesh, pre_tokens=3, next_tokens=0),
        "kl_bsnd_head_tail": lambda: case_kl_loss(
            mesh, head_tail=True, shape=dict(b=2, s1=24, s2=30)
        ),
        "kl_tnd_cp": lambda: case_kl_loss(mesh, "TND", shape=dict(lengths=UNEVEN_VARLEN)),
        "kl_tnd_cp_mode0": lambda: case_kl_loss(
            mesh, "TND", sparse_mode=0, shape=dict(lengths=UNEVEN_VARLEN)
        ),
        "kl_fused_op_bsnd": lambda: case_kl_fused_op(mesh),
        "kl_fused_op_tnd": lambda: case_kl_fused_op(mesh, "TND", lengths=UNEVEN_VARLEN),
        "kl_errors": lambda: case_kl_errors(mesh),
        "kl_empty_shards_batch_1": lambda: case_kl_loss(mesh, cp=False, shape=dict(b=1)),
        "kl_empty_shards_s1_1": lambda: case_kl_loss(mesh, shape=dict(b=2, s1=1, s2=4)),
        "kl_empty_shards_tnd_1": lambda: case_kl_loss(
            mesh, "TND", shape=dict(lengths=([1, 0], [2, 3]))
        ),
        "elementwise_default": lambda: case_elementwise_default(mesh),
        "raw_ops": lambda: case_raw_ops(mesh),
    }


KL_CASE_NAMES = [
    "kl_bsnd_cp",
    "kl_bsnd_dp_only",
    "kl_bsnd_cp_mode0",
    "kl_bsnd_cp_band",
    "kl_bsnd_head_tail",
    "kl_tnd_cp",
    "kl_tnd_cp_mode0",
    "kl_fused_op_bsnd",
    "kl_fused_op_tnd",
    "kl_errors",
    "kl_empty_shards_batch_1",
    "kl_empty_shards_s1_1",
    "kl_empty_shards_tnd_1",
    "elementwise_default",
    "raw_ops",
]


def case_raw_ops(mesh):
    """The indexer and the fused KL-loss operator called as torch.ops.opmesh.* with DTensors:
    DTensor runs them by their registered strategies (batch shards; rows for sparse_mode=0),
    with the numbers of the one-device call and of the DFunction path."""
    S = [S0] * mesh.ndim
    q, k, w, _ = _inputs("BSND", b=3, s1=9, s2=11)
    qlen, klen = torch.tensor([9, 4, 0]), torch.tensor([11, 7, 3])
    want = opmesh.dense_lightning_indexer_softmax_lse(
        q, k, w, actual_seq_qlen=qlen, actual_seq_klen=klen
    )
    dq, dk, dw, dql, dkl = (opmesh.distribute_tensor(x, mesh, S) for x in (q, k, w, qlen, klen))
    raw = torch.ops.opmesh.dense_lightning_indexer_softmax_lse
    got = raw(dq, dk, dw, actual_seq_qlen=dql, actual_seq_klen=dkl)
    via = opmesh.dense_lightning_indexer_softmax_lse(dq, dk, dw, actual_seq_qlen=qlen,
                                                     actual_seq_klen=klen)  # fmt: skip
    for g, v_, w_ in zip(got, via, want, strict=True):
        assert tuple(g.placements) == tuple(S), f"placements {g.placements}"
        assert torch.equal(g.full_tensor(), v_.full_tensor()), "raw op != DFunction path"
        _close(g, w_, "raw indexer")
    # No mask: query rows over the mesh, keys replicated.
    rows = [S1] * mesh.ndim
    want = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, sparse_mode=0)
    got = raw(
        opmesh.distribute_tensor(q, mesh, rows),
        opmesh.distribute_tensor(k, mesh, [R] * mesh.ndim),
        opmesh.distribute_tensor(w, mesh, rows),
        sparse_mode=0,
    )
    for g, w_ in zip(got, want, strict=True):
        assert tuple(g.placements) == (Shard(2),) * mesh.ndim, f"placements {g.placements}"
        _close(g, w_, "raw indexer, rows")
    # The fused KL-loss operator by batch: the loss is Partial, its sum the one-device loss.
    index, main, kw = _kl_inputs("BSND")
    stats = opmesh.dense_lightning_indexer_softmax_lse(*index.values(), **kw)
    tensors = {**index, **main}
    tensors.update(softmax_max_index=stats[0], softmax_sum_index=stats[1])
    order = ("query", "key", "query_index", "key_index", "weights", "softmax_max", "softmax_sum")
    order += ("softmax_max_index", "softmax_sum_index")
    rope = ("query_rope", "key_rope")
    want = torch.ops.opmesh.dense_lightning_indexer_grad_kl_loss(
        *(tensors[n] for n in order), 0.3, **{n: tensors[n] for n in rope}
    )
    dist = {n: opmesh.distribute_tensor(x, mesh, S) for n, x in tensors.items()}
    got = torch.ops.opmesh.dense_lightning_indexer_grad_kl_loss(
        *(dist[n] for n in order), 0.3, **{n: dist[n] for n in rope}
    )
    assert all(isinstance(p, Partial) for p in got[3].placements), f"loss {got[3].placements}"
    for what, g, w_ in zip(("d_query_index", "d_key_index", "d_weights", "loss"), got, want,
                           strict=True):  # fmt: skip
        _kl_close(g, w_, f"raw {what}")
