"""Graph mode for dense_lightning_indexer_softmax_lse: opcheck, and torch.compile equals eager."""

import pytest
import torch
from indexer_cases import CASES, make_inputs

import opmesh

OP = torch.ops.opmesh.dense_lightning_indexer_softmax_lse.default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[7]], ids=lambda c: c.name)
def test_opcheck(case, dtype):
    q, k, w, kwargs = make_inputs(case, dtype)
    torch.library.opcheck(OP, (q, k, w), kwargs)


def indexer(q, k, w, ql, kl, layout):
    return opmesh.dense_lightning_indexer_softmax_lse(
        q, k, w, actual_seq_qlen=ql, actual_seq_klen=kl, layout=layout, sparse_mode=3
    )


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_compile_fullgraph_equals_eager_with_new_shapes(layout, dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(indexer, fullgraph=True, dynamic=dynamic)
    cases = [c for c in CASES if c.layout == layout][:3]
    for case in cases:  # the later calls bring new shapes (and, for TND, new lengths)
        q, k, w, kwargs = make_inputs(case, torch.float32)
        ql, kl = kwargs.get("actual_seq_qlen"), kwargs.get("actual_seq_klen")
        want = indexer(q, k, w, ql, kl, layout)
        got = compiled(q, k, w, ql, kl, layout)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case.name


def test_compile_inside_a_larger_graph():
    """The op composes with surrounding ops: a log-sum-exp built from its outputs."""

    def lse(q, k, w):
        m, s = opmesh.dense_lightning_indexer_softmax_lse(q, k, w)
        return m + torch.log(s)

    q, k, w, _ = make_inputs(CASES[2], torch.float32)
    torch._dynamo.reset()
    got = torch.compile(lse, fullgraph=True, dynamic=True)(q, k, w)
    assert torch.equal(got, lse(q, k, w))
