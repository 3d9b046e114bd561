"""``python -m opmesh demo --framework mindspore``: the indexer and a KL-loss training step on
MindSpore tensors. The indexer's results are compared with the torch binding's on the same
inputs (the same core kernels: bitwise equal) and with a float64 evaluation of its formula on a
sample of rows; then an indexer (three MindSpore Dense layers) is trained for a few steps against
a frozen main attention through ``opmesh.indexer_kl_loss`` and MindSpore's autograd."""

from __future__ import annotations

import time

import numpy as np
import torch

import opmesh

from ._demo import _formula_rows
from .platform import mindspore_ops as binding


def _mindspore():
    try:
        import mindspore
    except ImportError:
        raise RuntimeError(
            "--framework: mindspore is not installed in this environment; `make test-mindspore` "
            "creates .venv-mindspore with it (docs/mindspore.md)"
        ) from None
    return mindspore


def run_mindspore_demo(seq=1024, heads=16, dim=64, steps=30):
    ms = _mindspore()
    start = time.perf_counter()
    binding.extension()
    print(
        f"opmesh demo on MindSpore {ms.__version__} (CPU): binding ready in "
        f"{time.perf_counter() - start:.1f} s (compiled once, then cached), kernels "
        f"{binding._call('active_isa')}"
    )
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seq, heads, dim), dtype=np.float32)
    k = rng.standard_normal((1, seq, 1, dim), dtype=np.float32)
    w = rng.standard_normal((1, seq, heads), dtype=np.float32) * (heads * dim) ** -0.5
    mq, mk, mw = (ms.Tensor(x).astype(ms.bfloat16) for x in (q, k, w[..., None]))
    mw = ms.Tensor(w)
    op = opmesh.dense_lightning_indexer_softmax_lse
    op(mq, mk, mw)
    start = time.perf_counter()
    m, s = op(mq, mk, mw)
    elapsed = time.perf_counter() - start
    print(
        f"\ndense_lightning_indexer_softmax_lse, BSND causal, bf16 MindSpore tensors "
        f"{tuple(mq.shape)}: softmax_max {tuple(m.shape)} {m.dtype}, {elapsed * 1e3:.1f} ms "
        f"({seq * (seq + 1) * heads * dim / elapsed / 1e9:.0f} GFLOP/s)"
    )
    tq, tk = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k))
    tm, ts = op(tq, tk, torch.from_numpy(w))
    same = np.array_equal(m.asnumpy(), tm.numpy()) and np.array_equal(s.asnumpy(), ts.numpy())
    print(f"  bitwise equal to the torch binding on the same inputs: {same}")
    rows = torch.unique(torch.linspace(0, seq - 1, 64).long())
    want_m, want_s = _formula_rows(tq, tk, torch.from_numpy(w), rows)
    err_m = np.abs(m.asnumpy()[0, 0, rows.numpy()] - want_m.numpy()).max()
    err_s = (np.abs(s.asnumpy()[0, 0, rows.numpy()] - want_s.numpy()) / want_s.numpy()).max()
    print(
        f"  vs float64 formula on {len(rows)} rows: max |err| of softmax_max {err_m:.2e}, "
        f"max rel err of softmax_sum {err_s:.2e}"
    )
    _training(ms, steps)


def _training(ms, steps, batch=2, seq=128, model=64, heads=4, head_dim=32, index_heads=4):
    """A few indexer training steps on MindSpore: the main attention (frozen projections)
    attends mostly to earlier copies of the same token; the indexer learns to point there."""
    from mindspore import nn

    index_dim = 16
    rng = np.random.default_rng(1)
    vocab = rng.standard_normal((32, model)).astype(np.float32)
    w_q = ms.Tensor(rng.standard_normal((model, heads * head_dim)).astype(np.float32) * 0.25)
    w_k = ms.Tensor(rng.standard_normal((model, head_dim)).astype(np.float32) * 0.25)
    scale = head_dim**-0.5

    class Indexer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.query = nn.Dense(model, index_heads * index_dim, has_bias=False)
            self.key = nn.Dense(model, index_dim, has_bias=False)
            self.weight = nn.Dense(model, index_heads, has_bias=False)

    indexer = Indexer()
    query, key, weight = indexer.query, indexer.key, indexer.weight
    optimizer = nn.Adam(indexer.trainable_params(), learning_rate=1e-2)

    def batch_of_tokens():
        tokens = rng.integers(0, 32, (batch, seq))
        noise = 0.3 * rng.standard_normal((batch, seq, model))
        return ms.Tensor((vocab[tokens] + noise).astype(np.float32))

    def loss_of(x):
        q = ms.ops.matmul(x, w_q).reshape(batch, seq, heads, head_dim)
        k = ms.ops.matmul(x, w_k).reshape(batch, seq, 1, head_dim)
        _, lse = opmesh.flash_attn(
            q, k, k, softmax_scale=scale, mask_mode=3, return_softmax_lse=True
        )
        softmax_max = lse.transpose(0, 2, 1).reshape(batch, 1, seq, heads)
        query_index = query(x).reshape(batch, seq, index_heads, index_dim)
        key_index = key(x).reshape(batch, seq, 1, index_dim)
        weights = weight(x) * (index_heads * index_dim) ** -0.5
        loss = opmesh.indexer_kl_loss(
            query_index,
            key_index,
            weights,
            q,
            k,
            softmax_max,
            ms.ops.ones_like(softmax_max),
            scale,
        )
        return loss.sum() / (batch * seq)

    step = ms.value_and_grad(loss_of, None, optimizer.parameters)
    print(f"\nindexer_kl_loss training on MindSpore: batch {batch} x {seq} tokens, {steps} steps")
    first = None
    for i in range(1, steps + 1):
        value, grads = step(batch_of_tokens())
        optimizer(grads)
        first = float(value.asnumpy()) if first is None else first
        if i == 1 or i % max(1, steps // 5) == 0:
            print(f"  step {i:3d}  KL per token {float(value.asnumpy()):.4f}")
    print(f"  KL per token: {first:.4f} -> {float(value.asnumpy()):.4f}")
