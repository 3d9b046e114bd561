"""opmesh on MindSpore tensors against the same operators on torch tensors (one core, two
bindings: the difference is each binding's overhead and thread pool) and against what a
MindSpore CPU user would write without opmesh: attention composed from MindSpore ops (batched
matmul, causal mask, softmax, matmul; MindSpore's fused attention ops are Ascend-only).

Runs in the MindSpore environment: .venv-mindspore/bin/python benchmarks/bench_mindspore.py
(after `make test-mindspore`). Writes benchmarks/results/mindspore.md.
"""

from __future__ import annotations

import os
import sys

import mindspore as ms
import numpy as np
import torch
from mindspore.graph.api import _pynative_executor

sys.path.insert(0, os.path.dirname(__file__))
from common import time_call, write_results  # noqa: E402

import opmesh  # noqa: E402


def synced(fn):
    def call():
        out = fn()
        _pynative_executor.sync()
        return out

    return call


def composed_attention(q, k, v, group):
    """Causal GQA attention from MindSpore ops, [B, S, N, D] in and out (float32)."""
    b, s, n, d = q.shape
    k = ms.ops.repeat_interleave(k, group, axis=2)
    v = ms.ops.repeat_interleave(v, group, axis=2)
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scores = ms.ops.matmul(qt, kt.transpose(0, 1, 3, 2)) * d**-0.5
    mask = ms.Tensor(np.triu(np.full((s, s), -np.inf, np.float32), 1))
    probs = ms.ops.softmax(scores + mask, axis=-1)
    return ms.ops.matmul(probs, vt).transpose(0, 2, 1, 3)


def main():
    seq, heads_q, heads_kv, dim = 2048, 8, 2, 128
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seq, heads_q, dim)).astype(np.float32)
    k = rng.standard_normal((1, seq, heads_kv, dim)).astype(np.float32)
    v = rng.standard_normal((1, seq, heads_kv, dim)).astype(np.float32)
    flops = 2 * 2 * heads_q * dim * seq * (seq + 1) / 2  # causal: QK^T and PV over the triangle
    rows = []
    composed_s = None
    for dtype in ("float32", "bfloat16"):
        tq, tk, tv = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v))
        mq, mk, mv = (ms.Tensor(x.float().numpy()).astype(getattr(ms, dtype)) for x in (tq, tk, tv))
        on_ms = time_call(synced(lambda m=(mq, mk, mv): opmesh.flash_attn(*m, mask_mode=3)))
        on_torch = time_call(lambda t=(tq, tk, tv): opmesh.flash_attn(*t, mask_mode=3))
        if composed_s is None:
            f32 = [ms.Tensor(x) for x in (q, k, v)]
            composed_s = time_call(
                synced(lambda f=f32: composed_attention(*f, heads_q // heads_kv)), budget_s=5.0
            )
        rows.append(
            {
                "op": "flash_attn causal fwd",
                "dtype": dtype,
                "opmesh on MindSpore ms": f"{on_ms * 1e3:.1f}",
                "GFLOP/s": f"{flops / on_ms / 1e9:.0f}",
                "opmesh on torch ms": f"{on_torch * 1e3:.1f}",
                "MindSpore / torch": f"{on_ms / on_torch:.2f}",
                "composed MindSpore ops (fp32) ms": f"{composed_s * 1e3:.1f}",
                "speed-up vs composed": f"{composed_s / on_ms:.1f}x",
            }
        )
    qi = rng.standard_normal((1, seq, 16, 64)).astype(np.float32)
    ki = rng.standard_normal((1, seq, 1, 64)).astype(np.float32)
    wi = (rng.standard_normal((1, seq, 16)) * 0.03).astype(np.float32)
    tqi, tki = (torch.from_numpy(x).bfloat16() for x in (qi, ki))
    mqi, mki = (ms.Tensor(x.float().numpy()).astype(ms.bfloat16) for x in (tqi, tki))
    index = opmesh.dense_lightning_indexer_softmax_lse
    on_ms = time_call(synced(lambda: index(mqi, mki, ms.Tensor(wi))))
    on_torch = time_call(lambda: index(tqi, tki, torch.from_numpy(wi)))
    index_flops = 2 * 16 * 64 * seq * (seq + 1) / 2
    rows.append(
        {
            "op": "indexer causal",
            "dtype": "bfloat16",
            "opmesh on MindSpore ms": f"{on_ms * 1e3:.1f}",
            "GFLOP/s": f"{index_flops / on_ms / 1e9:.0f}",
            "opmesh on torch ms": f"{on_torch * 1e3:.1f}",
            "MindSpore / torch": f"{on_ms / on_torch:.2f}",
        }
    )
    columns = list(rows[0])
    notes = [
        f"B=1, S={seq}, {heads_q} query / {heads_kv} key-value heads, D={dim} (indexer: 16 "
        "heads, D=64, one key head). Median wall time. MindSpore "
        f"{ms.__version__}; the binding's threads: OPMESH_NUM_THREADS="
        f"{os.environ.get('OPMESH_NUM_THREADS', 'unset (all CPU threads)')}.",
        "The composed MindSpore attention runs in float32 (its row is the same for both dtypes).",
        "Each binding makes its own measured bf16 kernel choice (OPMESH_BF16_KERNELS=auto): the "
        "bf16 rows can differ by that choice alone; the line above gives the torch binding's.",
    ]
    print(write_results("mindspore", rows, columns, notes))


if __name__ == "__main__":
    main()
