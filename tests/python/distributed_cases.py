"""Cases run on real process groups (gloo, spawned processes) by test_distributed.py.

Each case takes the device mesh and raises on failure. Results are compared with the
single-device call on the same inputs, which every rank computes itself.
"""

from __future__ import annotations

import torch
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


def _expect(exc, prefix, fn):
    """The call raises `exc` whose message starts with `prefix` (the argument's name first)."""
    try:
        fn()
    except exc as e:
        assert str(e).startswith(prefix), f"message {str(e)!r} does not start with {prefix!r}"
        return
    raise AssertionError(f"expected {exc.__name__} starting with {prefix!r}")


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
            opmesh.distribute_tensor(tq, mesh, on_last(S0)),
            opmesh.distribute_tensor(tk, mesh, on_last(S0)),
            opmesh.distribute_tensor(tw, mesh, on_last(S0)),
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
    return _cp_cases(mesh)


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
]
TWO_AXIS_CASES = ["one_dim_two_axes_tnd_10", "one_dim_two_axes_batch_3", "one_dim_two_axes_s1_9"]
