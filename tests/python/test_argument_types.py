"""Integer and bool arguments are taken strictly by every public function: a bool where the
operator declares an int (``sparse_count=True`` would run with K = 1), or a value other than a
bool, 0 or 1 where it declares a bool (``return_value=2``), raises TypeError naming it. The
checks come from the schemas (opmesh._schema), before anything runs."""

import inspect

import pytest
import torch

import opmesh
from opmesh import _schema

T = torch.zeros(1)

# Each public function with the operator whose declaration types its scalars.
FUNCTIONS = {
    opmesh.dense_lightning_indexer_softmax_lse: "dense_lightning_indexer_softmax_lse",
    opmesh.dense_lightning_indexer_grad_kl_loss: "dense_lightning_indexer_grad_kl_loss",
    opmesh.indexer_kl_loss: "dense_lightning_indexer_grad_kl_loss",
    opmesh.sparse_lightning_indexer_grad_kl_loss: "sparse_lightning_indexer_grad_kl_loss",
    opmesh.sparse_indexer_kl_loss: "sparse_lightning_indexer_grad_kl_loss",
    opmesh.lightning_indexer: "lightning_indexer",
    opmesh.sparse_flash_attention: "sparse_flash_attention",
    opmesh.sparse_flash_mla: "sparse_flash_mla",
    opmesh.sparse_flash_mla_metadata: "sparse_flash_mla_metadata",
    opmesh.compressor: "compressor",
    opmesh.flash_attn: "flash_attn",
    opmesh.flash_attn_metadata: "flash_attn_metadata",
}


def _required(function):
    """Placeholder values for the parameters without a default (tensors, or 1 for ints): the
    type check comes first, so they are never read."""
    out = {}
    for name, p in inspect.signature(function).parameters.items():
        if p.default is inspect.Parameter.empty:
            out[name] = 1 if name in _schema._INTS.get(FUNCTIONS[function], ()) else T
    return out


CASES = [
    (f, name, kind)
    for f, op in FUNCTIONS.items()
    for kind, names in (("int", _schema._INTS[op]), ("bool", _schema._BOOLS[op]))
    for name in names
    if name in inspect.signature(f).parameters
]


def test_every_int_and_bool_argument_is_covered():
    kinds = {(f.__name__, kind) for f, _, kind in CASES}
    assert ("lightning_indexer", "int") in kinds and ("lightning_indexer", "bool") in kinds
    assert ("flash_attn_metadata", "bool") in kinds and ("flash_attn", "int") in kinds
    assert {f for f, _, _ in CASES} == set(FUNCTIONS)


@pytest.mark.parametrize(
    "function, name, kind", CASES, ids=lambda x: getattr(x, "__name__", str(x))
)
def test_a_wrong_scalar_type_is_refused_by_name(function, name, kind):
    kwargs = _required(function)
    bad = [True, False] if kind == "int" else [2, -1, 1.0, "yes", None]
    for value in bad:
        kwargs[name] = value
        with pytest.raises(TypeError, match=f"^{name}: expected an? {kind}"):
            function(**kwargs)


def test_zero_and_one_stand_for_false_and_true():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 4, 16, generator=g), torch.randn(1, 6, 1, 16, generator=g)
    w = torch.randn(1, 6, 4, generator=g)
    as_int = opmesh.lightning_indexer(q, k, w, sparse_count=3, return_value=1)
    as_bool = opmesh.lightning_indexer(q, k, w, sparse_count=3, return_value=True)
    assert as_int[1].numel() == as_bool[1].numel() > 0
    torch.testing.assert_close(as_int, as_bool, rtol=0, atol=0)
    assert opmesh.lightning_indexer(q, k, w, sparse_count=3, return_value=0)[1].numel() == 0


def test_an_int_sparse_count_is_not_taken_from_a_bool():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 4, 16, generator=g), torch.randn(1, 6, 1, 16, generator=g)
    w = torch.randn(1, 6, 4, generator=g)
    with pytest.raises(TypeError, match="^sparse_count: expected an int, got a bool"):
        opmesh.lightning_indexer(q, k, w, sparse_count=True)
    with pytest.raises(TypeError, match="^return_softmax_lse: expected a bool"):
        opmesh.sparse_flash_attention(q, k, k, torch.zeros(1, 6, 1, 1, dtype=torch.int32), 1.0,
                                      return_softmax_lse=2)  # fmt: skip
