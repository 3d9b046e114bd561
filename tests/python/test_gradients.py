"""No gradient is ever dropped silently: flash_attn (no backward yet) raises a RuntimeError
naming the op when a gradient is asked of it, eagerly, through torch.ops and compiled;
kv_cache_write_ refuses grad-requiring arguments; the indexer's statistics never require a
gradient; every op compiles with grad-enabled inputs."""

import pytest
import torch

import opmesh

g = torch.Generator().manual_seed(0)


def qkv(requires_grad=True):
    q = torch.randn(1, 9, 4, 16, generator=g, requires_grad=requires_grad)
    k = torch.randn(1, 9, 2, 16, generator=g, requires_grad=requires_grad)
    v = torch.randn(1, 9, 2, 16, generator=g, requires_grad=requires_grad)
    return q, k, v


CALLS = {
    "function": lambda q, k, v: opmesh.flash_attn(q, k, v, mask_mode=3)[0],
    "torch_ops": lambda q, k, v: torch.ops.opmesh.flash_attn(q, k, v, mask_mode=3)[0],
    "lse_only": lambda q, k, v: opmesh.flash_attn(q, k, v, return_softmax_lse=True)[1],
    "sinks": lambda q, k, v: opmesh.flash_attn(
        q.detach(), k.detach(), v.detach(), sinks=torch.zeros(4, requires_grad=True)
    )[0],
    "compiled": torch.compile(
        lambda q, k, v: opmesh.flash_attn(q, k, v, mask_mode=3)[0], fullgraph=True
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_flash_attn_backward_raises_naming_the_op(call):
    out = CALLS[call](*qkv())
    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(RuntimeError, match=r"^flash_attn: has no backward"):
        out.sum().backward()


def test_flash_attn_forward_with_grad_inputs_is_unchanged():
    q, k, v = qkv()
    want = opmesh.flash_attn(q.detach(), k.detach(), v.detach(), mask_mode=3)[0]
    assert torch.equal(CALLS["function"](q, k, v).detach(), want)
    assert torch.equal(CALLS["compiled"](q, k, v).detach(), want)
    with torch.no_grad():
        out = CALLS["function"](q, k, v)
    assert not out.requires_grad


def test_flash_attn_gradient_of_an_input_that_needs_none_is_not_asked():
    # Only k requires a gradient: asking for it still raises; q's absence changes nothing.
    q, k, v = qkv(requires_grad=False)
    k.requires_grad_(True)
    out = opmesh.flash_attn(q, k, v)[0]
    with pytest.raises(RuntimeError, match=r"^flash_attn:"):
        torch.autograd.grad(out.sum(), k)


INDEXER = {
    "function": lambda q, k, w, lens: opmesh.dense_lightning_indexer_softmax_lse(
        q, k, w, actual_seq_qlen=lens
    ),
    "torch_ops": lambda q, k, w, lens: torch.ops.opmesh.dense_lightning_indexer_softmax_lse(
        q, k, w, actual_seq_qlen=lens
    ),
}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("call", sorted(INDEXER))
def test_indexer_outputs_are_not_differentiable(call, compiled):
    q, k, _ = qkv()
    w = torch.randn(1, 9, 4, generator=g, requires_grad=True)
    lens = torch.tensor([7])
    fn = INDEXER[call]
    if compiled:
        fn = torch.compile(fn, fullgraph=True, dynamic=True)
    m, s = fn(q, k, w, lens)
    assert not m.requires_grad and not s.requires_grad
    want = opmesh.dense_lightning_indexer_softmax_lse(
        q.detach(), k.detach(), w.detach(), actual_seq_qlen=lens
    )
    assert torch.equal(m, want[0]) and torch.equal(s, want[1])


def _kv_args(requires_grad):
    key = torch.randn(3, 2, 16, generator=g, requires_grad=requires_grad)
    value = torch.randn(3, 2, 16, generator=g)
    return key, value, torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16), torch.tensor([0, 5, 2])


@pytest.mark.parametrize("compiled", [False, True])
def test_kv_cache_write_refuses_grad_requiring_inputs(compiled):
    key, value, kc, vc, slots = _kv_args(requires_grad=True)
    fn = opmesh.kv_cache_write_
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    with pytest.raises(Exception, match=r"kv_cache_write_: key requires a gradient") as info:
        fn(key, value, kc, vc, slots)
    if not compiled:
        assert str(info.value).startswith("kv_cache_write_:")
    assert kc.abs().sum() == 0  # nothing written
    with torch.no_grad():
        fn(key, value, kc, vc, slots)
    assert torch.equal(kc[0, 0], key.detach()[0])


def test_kv_cache_write_refuses_a_grad_requiring_cache():
    key, value, kc, vc, slots = _kv_args(requires_grad=False)
    kc.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^kv_cache_write_: key_cache requires a gradient"):
        opmesh.kv_cache_write_(key, value, kc, vc, slots)
