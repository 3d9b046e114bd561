"""Extreme inputs end as a correct result or a named exception, never a crash or a silent wrong
answer. Stride-0 `expand` makes huge sizes cheap to send, so every size stored narrower than
int64 is range-checked before anything narrows it."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from attention_reference import flash_attn_reference
from conftest import assert_names_argument, assert_raises_named

import opmesh

g = torch.Generator().manual_seed(0)


def big(shape, dtype=torch.float32):
    """A tensor of the given shape backed by one element."""
    return torch.zeros([1] * len(shape), dtype=dtype).expand(*shape)


Q, K, V = (torch.randn(1, 8, 4, 16, generator=g), *(torch.randn(1, 8, 2, 16, generator=g),) * 2)
TND = dict(layout_q="TND", layout_kv="TND", layout_out="TND")

HUGE = {
    # flash_attn sizes
    "keys_2_37": (
        ValueError,
        "k",
        lambda: opmesh.flash_attn(Q, big((1, 2**37, 2, 16)), big((1, 2**37, 2, 16))),
    ),
    "queries_2_31": (ValueError, "q", lambda: opmesh.flash_attn(big((1, 2**31, 4, 16)), K, V)),
    "batch_2_31": (
        ValueError,
        "q",
        lambda: opmesh.flash_attn(
            big((2**31, 8, 4, 16)), big((2**31, 8, 2, 16)), big((2**31, 8, 2, 16))
        ),
    ),
    "tnd_tokens": (
        ValueError,
        "q",
        lambda: opmesh.flash_attn(
            big((2**33, 4, 16)),
            big((9, 2, 16)),
            big((9, 2, 16)),
            cu_seqlens_q=[0, 9],
            cu_seqlens_kv=[0, 9],
            **TND,
        ),
    ),
    "heads_2_17": (
        ValueError,
        "num_heads_q",
        lambda: opmesh.flash_attn(big((1, 8, 2**17, 16)), big((1, 8, 1, 16)), big((1, 8, 1, 16))),
    ),
    "head_dim_2_40": (
        ValueError,
        "head_dim",
        lambda: opmesh.flash_attn(big((1, 8, 4, 2**40)), big((1, 8, 2, 2**40)), V),
    ),
    "head_dim_v_2_40": (
        ValueError,
        "head_dim_v",
        lambda: opmesh.flash_attn(Q, K, big((1, 8, 2, 2**40))),
    ),
    "plan_seqlen": (
        ValueError,
        "max_seqlen_kv",
        lambda: opmesh.flash_attn_metadata(
            4, 2, 16, batch_size=1, max_seqlen_q=8, max_seqlen_kv=2**37
        ),
    ),
    "plan_batch": (
        ValueError,
        "batch_size",
        lambda: opmesh.flash_attn_metadata(
            4, 2, 16, batch_size=2**40, max_seqlen_q=8, max_seqlen_kv=8
        ),
    ),
    "mask_mode_wide": (
        ValueError,
        "mask_mode",
        lambda: opmesh.flash_attn(Q, K, V, mask_mode=2**32 + 3),
    ),
    "plan_mask_mode_wide": (
        ValueError,
        "mask_mode",
        lambda: opmesh.flash_attn_metadata(
            4, 2, 16, batch_size=1, max_seqlen_q=8, max_seqlen_kv=8, mask_mode=2**32 + 3
        ),
    ),
    "win_left_negative": (
        ValueError,
        "win_left",
        lambda: opmesh.flash_attn(Q, K, V, mask_mode=4, win_left=-(2**62)),
    ),
    "length_list_wide": (
        ValueError,
        "seqused_q",
        lambda: opmesh.flash_attn(Q, K, V, seqused_q=[2**40]),
    ),
    # the indexer
    "indexer_dim_2_58": (
        ValueError,
        "query_index",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            big((1, 1, 1, 2**58)), big((1, 1, 1, 2**58)), big((1, 1, 1))
        ),
    ),
    "indexer_dim_2_40": (
        ValueError,
        "query_index",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            big((1, 8, 4, 2**40)), big((1, 8, 2, 2**40)), big((1, 8, 4))
        ),
    ),
    "indexer_heads_2_31": (
        ValueError,
        "query_index",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            big((1, 8, 2**31, 16)), big((1, 8, 1, 16)), big((1, 8, 2**31))
        ),
    ),
    # lists of lengths
    "float_lengths_flash": (
        TypeError,
        "seqused_kv",
        lambda: opmesh.flash_attn(Q, K, V, seqused_kv=[1.5]),
    ),
    "float_lengths_plan": (
        TypeError,
        "cu_seqlens_q",
        lambda: opmesh.flash_attn_metadata(
            4,
            2,
            16,
            batch_size=1,
            max_seqlen_q=8,
            max_seqlen_kv=8,
            cu_seqlens_q=[0, 2.0],
            cu_seqlens_kv=[0, 2],
            **TND,
        ),
    ),
    "float_lengths_indexer": (
        TypeError,
        "actual_seq_qlen",
        lambda: opmesh.dense_lightning_indexer_softmax_lse(
            Q, K, torch.randn(1, 8, 4), actual_seq_qlen=[7.9]
        ),
    ),
    "float_slots": (
        TypeError,
        "slot_mapping",
        lambda: opmesh.kv_cache_write_(
            torch.randn(2, 2, 16),
            torch.randn(2, 2, 16),
            torch.zeros(2, 4, 2, 16),
            torch.zeros(2, 4, 2, 16),
            [0, 1.0],
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(HUGE))
def test_extreme_sizes_are_refused_by_name(name):
    exc, argument, fn = HUGE[name]
    assert_raises_named(exc, argument, fn)


@pytest.mark.parametrize("win", [2**31, 2**40, 2**62, 2**63 - 1])
@pytest.mark.parametrize("side", ["win_left", "win_right"])
def test_huge_windows_are_unbounded(win, side):
    kw = dict(mask_mode=4, win_left=2, win_right=1)
    kw[side] = win
    unbounded = dict(kw, **{side: -1})
    want, want_lse = opmesh.flash_attn(Q, K, V, return_softmax_lse=True, **unbounded)
    got, lse = opmesh.flash_attn(Q, K, V, return_softmax_lse=True, **kw)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert torch.isfinite(lse).all()
    # A plan made with the same huge window serves the call.
    plan = opmesh.flash_attn_metadata(4, 2, 16, batch_size=1, max_seqlen_q=8, max_seqlen_kv=8, **kw)
    assert torch.equal(opmesh.flash_attn(Q, K, V, metadata=plan, **kw)[0], want)
    ref, _ = flash_attn_reference(Q, K, V, **unbounded)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_infinite_sink_takes_all_the_mass():
    sinks = torch.tensor([math.inf, 0.5, math.inf, -math.inf])
    out, lse = opmesh.flash_attn(Q, K, V, sinks=sinks, mask_mode=3, return_softmax_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    for h in (0, 2):
        assert torch.equal(out[:, :, h], torch.zeros_like(out[:, :, h]))
        assert torch.isposinf(lse[:, h]).all()
    ref, ref_lse = flash_attn_reference(Q, K, V, sinks=sinks, mask_mode=3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_nan_sink_reaches_its_head_only():
    sinks = torch.tensor([0.5, math.nan, -0.25, 1.0])
    out, lse = opmesh.flash_attn(Q, K, V, sinks=sinks, mask_mode=3, return_softmax_lse=True)
    assert out[:, :, 1].isnan().all() and lse[:, 1].isnan().all()
    others = [0, 2, 3]
    # Heads 0, 2 and 3 as a call without head 1 gives them (query heads 0 and 1 share key head 0).
    ref, ref_lse = flash_attn_reference(
        Q[:, :, others], K[:, :, [0, 1, 1]], V[:, :, [0, 1, 1]], sinks=sinks[others], mask_mode=3
    )
    torch.testing.assert_close(out[:, :, others].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, others].double(), ref_lse, atol=1e-5, rtol=1e-5)


# -- kv_cache_write_ refuses memory that overlaps ------------------------------------------


def _kv():
    key, value = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    return key, value, torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16), [0, 5, 2]


def _overlap(which):
    key, value, kc, vc, slots = _kv()
    if which == "expanded_cache":
        kc = torch.zeros(1, 4, 2, 16).expand(2, 4, 2, 16)
    elif which == "value_cache_is_view":
        vc = kc.view(2, 4, 2, 16)
    elif which == "value_cache_overlaps":
        storage = torch.zeros(3 * 4 * 2 * 16)
        kc = storage[: 2 * 128].view(2, 4, 2, 16)
        vc = storage[128:].view(2, 4, 2, 16)
    elif which == "key_in_cache":
        key = kc[0, :3]
    elif which == "value_in_value_cache":
        value = vc.view(8, 2, 16)[:3]
    return key, value, kc, vc, slots


OVERLAPS = {
    "expanded_cache": "key_cache",
    "value_cache_is_view": "value_cache",
    "value_cache_overlaps": "value_cache",
    "key_in_cache": "key",
    "value_in_value_cache": "value",
}


@pytest.mark.parametrize("which", sorted(OVERLAPS))
def test_kv_cache_write_refuses_overlapping_memory(which):
    key, value, kc, vc, slots = _overlap(which)
    before = (kc.clone(), vc.clone())
    with pytest.raises(ValueError) as info:
        opmesh.kv_cache_write_(key, value, kc, vc, slots)
    assert_names_argument(info.value, OVERLAPS[which])
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_expanded_block_table_is_read_in_place():
    """[1, 2^31] expanded: only the entries the call uses are read, nothing is copied (the
    child's peak memory stays far below the 8 GiB a copy would take)."""
    script = textwrap.dedent(
        """
        import resource, torch, opmesh
        from attention_reference import flash_attn_reference
        g = torch.Generator().manual_seed(1)
        cache_k = torch.randn(3, 4, 2, 16, generator=g)
        cache_v = torch.randn(3, 4, 2, 16, generator=g)
        q = torch.randn(1, 5, 4, 16, generator=g)
        table = torch.tensor([[2]], dtype=torch.int32).expand(1, 2**31)
        kw = dict(layout_kv="PA_BBND", block_table=table, seqused_kv=[3], mask_mode=3)
        out = opmesh.flash_attn(q, cache_k, cache_v, **kw)[0]
        kw["seqused_kv"] = torch.tensor([3])
        ref = flash_attn_reference(q, cache_k, cache_v, **kw)[0]
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(__file__),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak_kb = int(done.stdout.split("PEAK_KB")[1])
    assert peak_kb < 2 * 1024 * 1024, f"peak RSS {peak_kb} KiB"


# -- the private plan reader verifies before it walks -------------------------------------


def test_plan_pieces_verifies_the_plan_and_its_arguments():
    from opmesh import _C
    from opmesh.ops import plan_bytes

    plan = opmesh.flash_attn_metadata(4, 2, 16, batch_size=2, max_seqlen_q=8, max_seqlen_kv=8)
    words = plan_bytes(plan)
    assert len(_C._plan_pieces(words, [(8, 8), (8, 8)])) == plan_worker_count(plan)
    with pytest.raises(TypeError):
        _C._plan_pieces(words)
    with pytest.raises(ValueError, match="^lengths:"):
        _C._plan_pieces(words, [(8, 8)])
    with pytest.raises(ValueError, match="^lengths:"):
        _C._plan_pieces(words, [(8, 8), (9, 8)])
    # Every single forged word: refused with a ValueError or still an exact cover, never a crash
    # (run in a child process so a crash would fail this test rather than the run).
    script = textwrap.dedent(
        f"""
        import array, opmesh
        from opmesh import _C
        words = array.array("i", {list(plan.tolist())!r})
        for i in range(len(words)):
            for value in (-1, 0, 1, 7, 2**31 - 1, -(2**31)):
                forged = array.array("i", words)
                forged[i] = value
                try:
                    _C._plan_pieces(forged.tobytes(), [(8, 8), (8, 8)])
                except ValueError:
                    pass
        print("DONE")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-2000:]


def plan_worker_count(plan):
    return opmesh.describe_metadata(plan)["num_workers"]
