"""Graph mode never pins a size: plans made inside compiled or exported code follow the shapes,
an exported plan runs with any thread count, shape functions refuse what the kernels refuse, and
a tensor argument on another device (meta included) is refused by every kernel and fake."""

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_raises_named
from torch._dynamo.testing import CompileCounterWithBackend

import opmesh

TND = dict(mask_mode=3, layout_q="TND", layout_kv="TND", layout_out="TND")


def plan_and_attend(q, k, v, cu):
    plan = opmesh.flash_attn_metadata(
        4,
        2,
        16,
        batch_size=cu.shape[0] - 1,
        max_seqlen_q=q.shape[0],
        max_seqlen_kv=k.shape[0],
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        **TND,
    )
    return opmesh.flash_attn(q, k, v, metadata=plan, cu_seqlens_q=cu, cu_seqlens_kv=cu, **TND)[0]


def varlen(t, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 4, 16, generator=gen)
    k = torch.randn(t, 2, 16, generator=gen)
    v = torch.randn(t, 2, 16, generator=gen)
    return q, k, v, torch.tensor([0, t // 3, t], dtype=torch.int32)


def test_one_graph_serves_four_sequence_lengths_with_the_plan_inside():
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(plan_and_attend, backend=counter, fullgraph=True, dynamic=True)
    for t in (20, 33, 47, 130):
        args = varlen(t, seed=t)
        assert torch.equal(compiled(*args), plan_and_attend(*args))
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"


class PlanInside(torch.nn.Module):
    def __init__(self, num_workers=None):
        super().__init__()
        self.num_workers = num_workers

    def forward(self, q, k, v):
        plan = opmesh.flash_attn_metadata(
            4,
            2,
            16,
            batch_size=q.shape[0],
            max_seqlen_q=q.shape[1],
            max_seqlen_kv=k.shape[1],
            mask_mode=3,
            num_workers=self.num_workers,
        )
        return opmesh.flash_attn(q, k, v, metadata=plan, mask_mode=3)[0]


def bsnd(s, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, s, 4, 16, generator=gen),
        torch.randn(2, s, 2, 16, generator=gen),
        torch.randn(2, s, 2, 16, generator=gen),
    )


def _export_saved_loaded(module):
    seq = torch.export.Dim("S", min=2, max=4096)
    program = torch.export.export(
        module, bsnd(10), dynamic_shapes={"q": {1: seq}, "k": {1: seq}, "v": {1: seq}}
    )
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer).module()


@pytest.mark.parametrize("num_workers", [None, 3])
def test_export_with_a_dim_on_the_sequence_saves_loads_and_runs_any_length(num_workers):
    loaded = _export_saved_loaded(PlanInside(num_workers))
    for s in (7, 10, 61):
        args = bsnd(s, seed=s)
        assert torch.equal(loaded(*args), PlanInside(num_workers)(*args))


def test_exported_default_plan_runs_with_any_thread_count():
    loaded = _export_saved_loaded(PlanInside())
    threads = torch.get_num_threads()
    try:
        for n in (1, 3, 5):
            torch.set_num_threads(n)
            args = bsnd(12, seed=n)
            assert torch.equal(loaded(*args), PlanInside()(*args))
    finally:
        torch.set_num_threads(threads)


# -- shape functions check what shapes, dtypes and values decide ---------------------------


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


SHAPE_CASES = {
    "heads_not_grouped": (
        ValueError,
        "k",
        lambda: opmesh.flash_attn(meta(1, 8, 6, 16), meta(1, 8, 4, 16), meta(1, 8, 4, 16)),
    ),
    "head_dim_mismatch": (
        ValueError,
        "k",
        lambda: opmesh.flash_attn(meta(1, 8, 4, 16), meta(1, 8, 2, 32), meta(1, 8, 2, 16)),
    ),
    "batch_mismatch": (
        ValueError,
        "k",
        lambda: opmesh.flash_attn(meta(2, 8, 4, 16), meta(1, 8, 2, 16), meta(1, 8, 2, 16)),
    ),
    "sinks_shape": (
        ValueError,
        "sinks",
        lambda: opmesh.flash_attn(
            meta(1, 8, 4, 16), meta(1, 8, 2, 16), meta(1, 8, 2, 16), sinks=meta(3)
        ),
    ),
    "mask_mode_wide": (
        ValueError,
        "mask_mode",
        lambda: opmesh.flash_attn(
            meta(1, 8, 4, 16), meta(1, 8, 2, 16), meta(1, 8, 2, 16), mask_mode=2**32 + 3
        ),
    ),
    "cu_entries": (
        ValueError,
        "cu_seqlens_kv",
        lambda: opmesh.flash_attn(
            meta(9, 4, 16),
            meta(9, 2, 16),
            meta(9, 2, 16),
            cu_seqlens_q=meta(3, dtype=torch.int32),
            cu_seqlens_kv=meta(4, dtype=torch.int32),
            **TND,
        ),
    ),
    "indexer_heads": (
        ValueError,
        "key_index",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            meta(1, 8, 6, 16), meta(1, 8, 4, 16), meta(1, 8, 6)
        ),
    ),
    "indexer_weights": (
        ValueError,
        "weights",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            meta(1, 8, 4, 16), meta(1, 8, 2, 16), meta(1, 7, 4)
        ),
    ),
    "indexer_lengths_dtype": (
        TypeError,
        "actual_seq_qlen",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            meta(1, 8, 4, 16),
            meta(1, 8, 2, 16),
            meta(1, 8, 4),
            actual_seq_qlen=meta(1, dtype=torch.float32),
        ),
    ),
    "indexer_head_limit": (
        ValueError,
        "query_index",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            meta(1, 8, 2**17, 16), meta(1, 8, 1, 16), meta(1, 8, 2**17)
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
def test_shape_functions_refuse_what_the_kernels_refuse(name):
    exc, argument, fn = SHAPE_CASES[name]
    assert_raises_named(exc, argument, fn)


def test_export_refuses_grouping_that_does_not_divide():
    class Bad(torch.nn.Module):
        def forward(self, q, k, v):
            return opmesh.flash_attn(q, k, v)[0]

    args = (torch.randn(1, 8, 6, 16), torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16))
    with pytest.raises(Exception, match="k: 4 heads \\(dim 2 of BSND\\) do not divide q's 6"):
        torch.export.export(Bad(), args)


# -- every tensor argument on q's device, in every kernel and fake --------------------------

Q, K, V = bsnd(8)
TQ, TK, TV, CU = varlen(9)
DEVICE_CASES = {
    "flash_attn_cu_seqlens_q": (
        "cu_seqlens_q",
        lambda: opmesh.flash_attn(TQ, TK, TV, cu_seqlens_q=CU.to("meta"), cu_seqlens_kv=CU, **TND),
    ),
    "flash_attn_seqused_kv": (
        "seqused_kv",
        lambda: opmesh.flash_attn(Q, K, V, seqused_kv=torch.tensor([3, 4]).int().to("meta")),
    ),
    "flash_attn_metadata": (
        "metadata",
        lambda: opmesh.flash_attn(
            Q,
            K,
            V,
            metadata=opmesh.flash_attn_metadata(
                4, 2, 16, batch_size=2, max_seqlen_q=8, max_seqlen_kv=8
            ).to("meta"),
        ),
    ),
    "plan_lengths": (
        "cu_seqlens_q",
        lambda: opmesh.flash_attn_metadata(
            4,
            2,
            16,
            batch_size=2,
            max_seqlen_q=8,
            max_seqlen_kv=8,
            cu_seqlens_q=CU.to("meta"),
            cu_seqlens_kv=CU,
            **TND,
        ),
    ),
    "indexer_lengths": (
        "actual_seq_klen",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            Q, K, torch.randn(2, 8, 4), actual_seq_klen=torch.tensor([3, 4]).to("meta")
        ),
    ),
    "kv_cache_slots": (
        "slot_mapping",
        lambda: opmesh.kv_cache_write_(
            TK, TV, torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16), torch.arange(9).to("meta")
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(DEVICE_CASES))
def test_a_tensor_on_another_device_is_refused(name):
    argument, fn = DEVICE_CASES[name]
    assert_raises_named(ValueError, argument, fn)


def test_plan_fake_checks_entry_counts():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(Exception, match="cu_seqlens_q: expected 3 entries"):
        opmesh.flash_attn_metadata(
            4,
            2,
            16,
            batch_size=2,
            max_seqlen_q=8,
            max_seqlen_kv=8,
            cu_seqlens_q=torch.zeros(4, dtype=torch.int32),
            cu_seqlens_kv=torch.zeros(3, dtype=torch.int32),
            **TND,
        )


def test_aoti_package_with_the_default_plan_runs_with_any_thread_count(tmp_path):
    """AOTInductor, with its input checks on: the plan's length is not pinned to the thread
    count at compile time."""
    seq = torch.export.Dim("S", min=2, max=4096)
    program = torch.export.export(
        PlanInside(), bsnd(10), dynamic_shapes={"q": {1: seq}, "k": {1: seq}, "v": {1: seq}}
    )
    package = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "plan_inside.pt2")
    )
    script = textwrap.dedent(
        f"""
        import sys, torch, opmesh
        from test_graph_sizes import PlanInside, bsnd
        torch.set_num_threads(int(sys.argv[1]))
        runner = torch._inductor.aoti_load_package({package!r})
        for s in (7, 33):
            args = bsnd(s, seed=s)
            assert torch.equal(runner(*args), PlanInside()(*args)), s
        print("OK")
        """
    )
    for threads in (1, 3):
        done = subprocess.run(
            [sys.executable, "-c", script, str(threads)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            env=dict(os.environ, AOTI_RUNTIME_CHECK_INPUTS="1"),
        )
        assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
