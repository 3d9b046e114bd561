"""Cases run on real process groups (gloo, spawned processes) by test_distributed.py.

Each case takes the device mesh and raises on failure. Results are compared with the
single-device call on the same inputs, which every rank computes itself.
"""

from __future__ import annotations

import json
import os
import traceback

import torch
import torch.distributed as dist
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


def _expect(exc, fragment, fn):
    try:
        fn()
    except exc as e:
        assert fragment in str(e), f"message {str(e)!r} lacks {fragment!r}"
        return
    raise AssertionError(f"expected {exc.__name__} mentioning {fragment!r}")


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
            (lay.mesh, lay.placements),
        )

    def infer_layout(self, cache_values):
        return (cache_values,), None


def case_user_op_backward(mesh):
    if "test_row_rms_norm" not in opmesh.distributed.distributed_op._instances:
        RowRmsNormDistributed()
    x = torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
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
    _expect(ValueError, "rows must be whole", lambda: RowRmsNorm.apply(bad))


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
    _expect(ValueError, "_op_name", lambda: NoName.apply(dq))
    _expect(
        ValueError,
        "no DistributedOp is registered for op 'op_without_rule'",
        lambda: NoRule.apply(dq),
    )
    with opmesh.head_tail_cp():
        _expect(ValueError, "head_tail_cp", lambda: op(*dist3(axes, axes, axes)))


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
    return cases


def worker(rank, world, port, shape, names, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = opmesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
        results = {}
        for name, fn in _cp_cases(mesh).items():
            try:
                fn()
                results[name] = "ok"
            except Exception:  # reported per case by the parent test
                results[name] = f"rank {rank}: {traceback.format_exc()}"
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            # A case passes when it passed on every rank; otherwise keep the first failure.
            merged = {}
            for per_rank in gathered:
                for name, status in per_rank.items():
                    if merged.get(name, "ok") == "ok":
                        merged[name] = status
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump(merged, f)
        # Every rank reaches this point before any tears its groups down: a rank that leaves
        # early takes the store others still talk to.
        dist.barrier()
    finally:
        dist.destroy_process_group()


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
]
