"""No gradient is ever dropped silently: flash_attn's gradients reach q, k, v and sinks from every
call form (the Python function, torch.ops, through the lse only, compiled), each equal to the
others; kv_cache_write_ refuses grad-requiring arguments; the indexer's statistics never require
a gradient; every op compiles with grad-enabled inputs. (Gradient values against float64:
test_flash_attn_backward.py.)"""

import pytest
import torch

import opmesh

g = torch.Generator().manual_seed(0)


def qkv(requires_grad=True):
    q = torch.randn(1, 9, 4, 16, generator=g, requires_grad=requires_grad)
    k = torch.randn(1, 9, 2, 16, generator=g, requires_grad=requires_grad)
    v = torch.randn(1, 9, 2, 16, generator=g, requires_grad=requires_grad)
    return q, k, v


CALLS_SINKS = torch.zeros(4, requires_grad=True)
CALLS = {
    "function": lambda q, k, v: opmesh.flash_attn(q, k, v, mask_mode=3)[0],
    "torch_ops": lambda q, k, v: torch.ops.opmesh.flash_attn(q, k, v, mask_mode=3)[0],
    "lse_only": lambda q, k, v: opmesh.flash_attn(q, k, v, return_softmax_lse=True)[1],
    "sinks": lambda q, k, v: opmesh.flash_attn(
        q.detach(), k.detach(), v.detach(), sinks=CALLS_SINKS
    )[0],
    "compiled": torch.compile(
        lambda q, k, v: opmesh.flash_attn(q, k, v, mask_mode=3)[0], fullgraph=True
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_flash_attn_gradients_reach_every_input(call):
    q, k, v = qkv()
    out = CALLS[call](q, k, v)
    assert out.requires_grad and out.grad_fn is not None
    out.square().sum().backward()
    if call == "sinks":
        leaves = [CALLS_SINKS]
    elif call == "lse_only":  # the log-sum-exp depends on q and k only
        leaves = [q, k]
        assert not v.grad.any()
    else:
        leaves = [q, k, v]
    for x in leaves:
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_call_forms_give_the_same_gradients():
    q, k, v = qkv()
    grads = {}
    for call in ("function", "torch_ops", "compiled"):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        CALLS[call](*leaves).square().sum().backward()
        grads[call] = [x.grad for x in leaves]
    for call in ("torch_ops", "compiled"):
        for a, b in zip(grads["function"], grads[call], strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


def test_flash_attn_forward_with_grad_inputs_is_unchanged():
    q, k, v = qkv()
    want = opmesh.flash_attn(q.detach(), k.detach(), v.detach(), mask_mode=3)[0]
    assert torch.equal(CALLS["function"](q, k, v).detach(), want)
    assert torch.equal(CALLS["compiled"](q, k, v).detach(), want)
    with torch.no_grad():
        out = CALLS["function"](q, k, v)
    assert not out.requires_grad


def test_only_the_inputs_that_need_a_gradient_get_one():
    q, k, v = qkv(requires_grad=False)
    k.requires_grad_(True)
    out = opmesh.flash_attn(q, k, v)[0]
    (dk,) = torch.autograd.grad(out.sum(), k)
    assert dk.shape == k.shape and q.grad is None and v.grad is None


def test_an_unrequested_lse_is_not_differentiable():
    q, k, v = qkv()
    out, lse = opmesh.flash_attn(q, k, v)
    assert lse.numel() == 0 and not lse.requires_grad


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


def test_kv_cache_write_refuses_a_grad_requiring_scale():
    key, value, _, _, slots = _kv_args(requires_grad=False)
    caches = [torch.zeros(2, 4, *x.shape[1:], dtype=torch.int8) for x in (key, value)]
    scales = [torch.zeros(2, 4, key.shape[1]) for _ in range(2)]
    scales[1].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^kv_cache_write_: value_scale requires a gradient"):
        opmesh.kv_cache_write_(
            key, value, *caches, slots, key_scale=scales[0], value_scale=scales[1]
        )
    assert caches[0].abs().sum() == 0  # nothing written
