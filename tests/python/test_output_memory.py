"""Large CPU outputs are advised for transparent huge pages (OPMESH_HUGE_PAGES): the advice is on
the output's memory (its VMA carries the kernel's "hg" flag), off when the variable says so,
never on small outputs, and it changes no result; a bad value of the variable is refused."""

import sys
from pathlib import Path

import pytest
import torch

import opmesh

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="transparent huge pages are a Linux kernel feature this kernel lacks",
)


def vm_flags(t):
    """The VmFlags of the mapping that holds the middle byte of t's storage."""
    address = t.data_ptr() + t.numel() * t.element_size() // 2
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError("no mapping holds the tensor's storage")


def attention(seq, requires_grad=False):
    """flash_attn with a [1, seq, 64, 128] bf16 query (seq = 2048: a 32 MiB output) over 16 keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, 64, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 16, 8, 128, generator=g).to(torch.bfloat16)
    v = torch.randn(1, 16, 8, 128, generator=g).to(torch.bfloat16)
    q.requires_grad_(requires_grad)
    return q, opmesh.flash_attn(q, k, v)[0]


def test_large_outputs_are_advised(monkeypatch):
    monkeypatch.delenv("OPMESH_HUGE_PAGES", raising=False)
    q, out = attention(2048, requires_grad=True)
    assert out.numel() * out.element_size() == 32 << 20
    assert "hg" in vm_flags(out)
    out.backward(torch.ones_like(out))
    assert "hg" in vm_flags(q.grad)
    # The same bits as without the advice.
    monkeypatch.setenv("OPMESH_HUGE_PAGES", "off")
    q_off, out_off = attention(2048, requires_grad=True)
    out_off.backward(torch.ones_like(out_off))
    assert torch.equal(out, out_off)
    assert torch.equal(q.grad, q_off.grad)


def test_off_and_small_outputs_are_not_advised(monkeypatch):
    monkeypatch.setenv("OPMESH_HUGE_PAGES", "off")
    assert "hg" not in vm_flags(attention(2048)[1])
    monkeypatch.setenv("OPMESH_HUGE_PAGES", "on")
    # 2 MiB below the threshold, as a large allocation of its own (mapped afresh, not advised).
    assert "hg" not in vm_flags(attention(1920)[1])


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("OPMESH_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="^OPMESH_HUGE_PAGES: expected on or off, got 'yes'"):
        attention(16)
