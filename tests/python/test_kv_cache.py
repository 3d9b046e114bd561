"""kv_cache_write_: the in-place paged-cache write against index assignment, its errors, its
version counters, and a decode step (write, then flash_attn over the cache) compiled with
fullgraph over 16 consecutive steps without copying the cache."""

import pytest
import torch
from comparators import assert_close
from conftest import assert_names_argument

import opmesh

WRITE = torch.ops.opmesh.kv_cache_write_.default


def caches(num_blocks=6, block_size=16, heads=2, d=32, dv=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype),
        torch.randn(num_blocks, block_size, heads, dv, generator=g).to(dtype),
    )


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_matches_index_assignment(dtype, slot_dtype):
    kc, vc = caches(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    key = torch.randn(5, 2, 32, generator=g).to(dtype)
    value = torch.randn(5, 2, 24, generator=g).to(dtype)
    slots = torch.tensor([17, -1, 0, 95, 40], dtype=slot_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // 16, s % 16] = key[t]
            want_v[s // 16, s % 16] = value[t]
    versions = (kc._version, vc._version)
    opmesh.kv_cache_write_(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert kc._version > versions[0] and vc._version > versions[1]


def test_strided_inputs_and_caches():
    kc, vc = caches()
    big_k = torch.randn(6, 32, 4, 32)  # a cache viewed with a stride on heads
    kc_view = big_k[:, :16, ::2]
    key = torch.randn(3, 4, 32)[:, ::2]
    value = torch.randn(3, 24, 2).transpose(1, 2)
    want = kc_view.clone()
    for t, s in enumerate([3, 50, 7]):
        want[s // 16, s % 16] = key[t]
    opmesh.kv_cache_write_(key, value, kc_view, vc, [3, 50, 7])
    assert torch.equal(kc_view, want)
    assert torch.equal(vc[3 // 16, 3 % 16], value[0])


def test_opcheck():
    kc, vc = caches()
    key, value = torch.randn(4, 2, 32), torch.randn(4, 2, 24)
    torch.library.opcheck(WRITE, (key, value, kc, vc, torch.tensor([1, 2, -1, 80])))


CASES = {
    "slot_too_large": (ValueError, "slot_mapping", dict(slots=[0, 96])),
    "slot_below_minus_one": (ValueError, "slot_mapping", dict(slots=[-2, 1])),
    "slot_twice": (ValueError, "slot_mapping", dict(slots=[5, 5])),
    "slot_dtype": (TypeError, "slot_mapping", dict(slots=torch.tensor([0.0, 1.0]))),
    "slot_count": (ValueError, "slot_mapping", dict(slots=[0, 1, 2])),
    "key_dtype": (TypeError, "key_cache", dict(key=torch.randn(2, 2, 32).half())),
    "value_dtype": (TypeError, "value", dict(value=torch.randn(2, 2, 24).double())),
    "key_rank": (ValueError, "key", dict(key=torch.randn(2, 64))),
    "cache_rank": (ValueError, "key_cache", dict(kc=torch.randn(6, 16, 64))),
    "head_dim": (ValueError, "key_cache", dict(key=torch.randn(2, 2, 16))),
    "heads": (ValueError, "value", dict(value=torch.randn(2, 3, 24))),
    "value_cache_shape": (ValueError, "value_cache", dict(vc=torch.randn(5, 16, 2, 24))),
    "device": (ValueError, "key_cache", dict(kc=torch.randn(6, 16, 2, 32, device="meta"))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_names_the_argument(name):
    exc, argument, change = CASES[name]
    kc, vc = caches()
    args = dict(key=torch.randn(2, 2, 32), value=torch.randn(2, 2, 24), kc=kc, vc=vc, slots=[0, 1])
    args.update(change)
    before = vc.clone()
    with pytest.raises(exc) as info:
        opmesh.kv_cache_write_(args["key"], args["value"], args["kc"], args["vc"], args["slots"])
    assert_names_argument(info.value, argument)
    assert torch.equal(vc, before)  # nothing written


# --- a decode step under torch.compile --------------------------------------------------------

B, NQ, NKV, D, BS, MAX_BLOCKS = 3, 8, 2, 32, 16, 4


def decode_step(q, k_new, v_new, key_cache, value_cache, slot_mapping, block_table, seqused_kv):
    opmesh.kv_cache_write_(k_new, v_new, key_cache, value_cache, slot_mapping)
    out, lse = opmesh.flash_attn(
        q,
        key_cache,
        value_cache,
        block_table=block_table,
        seqused_kv=seqused_kv,
        layout_kv="PA_BBND",
        mask_mode=3,
        return_softmax_lse=True,
    )
    return out, lse


def decode_setup(num_blocks=B * MAX_BLOCKS + 2, seed=0):
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, BS, NKV, D, generator=g)
    value_cache = torch.randn(num_blocks, BS, NKV, D, generator=g)
    order = torch.randperm(num_blocks, generator=g)[: B * MAX_BLOCKS]
    block_table = order.view(B, MAX_BLOCKS).to(torch.int32)
    lengths = torch.tensor([5, 0, 20], dtype=torch.int32)  # tokens already cached
    return key_cache, value_cache, block_table, lengths


def step_inputs(step, block_table, lengths, g):
    q = torch.randn(B, 1, NQ, D, generator=g)
    k_new = torch.randn(B, NKV, D, generator=g)
    v_new = torch.randn(B, NKV, D, generator=g)
    pos = lengths.long()
    slots = block_table.long().gather(1, (pos // BS).view(B, 1)).view(B) * BS + pos % BS
    if step % 5 == 4:
        slots[1] = -1  # a padded batch entry this step: nothing written, length unchanged
    return q, k_new, v_new, slots


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_decode_equals_eager_for_16_steps(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=dynamic)
    eager_k, eager_v, block_table, lengths = decode_setup()
    comp_k, comp_v = eager_k.clone(), eager_v.clone()
    g = torch.Generator().manual_seed(1)
    for step in range(16):
        q, k_new, v_new, slots = step_inputs(step, block_table, lengths, g)
        seqused = lengths + (slots >= 0).to(torch.int32)
        want = decode_step(q, k_new, v_new, eager_k, eager_v, slots, block_table, seqused)
        got = compiled(q, k_new, v_new, comp_k, comp_v, slots, block_table, seqused)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {step}"
        assert torch.equal(comp_k, eager_k) and torch.equal(comp_v, eager_v), f"step {step}"
        lengths = seqused
    # The last step's output against the float64 reference over the final caches.
    from attention_reference import flash_attn_reference

    ref_out, _ = flash_attn_reference(
        q,
        eager_k,
        eager_v,
        block_table=block_table,
        seqused_kv=seqused,
        layout_kv="PA_BBND",
        mask_mode=3,
    )
    assert_close(got[0], ref_out, atol=2e-5, rtol=1e-4)


def test_compiled_decode_writes_the_cache_in_place():
    """The compiled step mutates the caller's cache buffers in place: the generated code
    allocates nothing of the cache's size and holds no copy of it."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    key_cache, value_cache, block_table, lengths = decode_setup(num_blocks=64)
    g = torch.Generator().manual_seed(1)
    q, k_new, v_new, slots = step_inputs(0, block_table, lengths, g)
    compiled = torch.compile(decode_step, fullgraph=True)
    pointer = key_cache.data_ptr()
    _, codes = run_and_get_code(
        compiled, q, k_new, v_new, key_cache, value_cache, slots, block_table, lengths + 1
    )
    code = "\n".join(codes)
    cache_shape = f"({64}, {BS}, {NKV}, {D})"
    # The op runs on the graph's input buffers themselves (re-inplaced after functionalization).
    assert "torch.ops.opmesh.kv_cache_write_.default(arg" in code, code
    assert f"empty_strided_cpu({cache_shape}" not in code
    assert "clone" not in code and ".copy_(" not in code, code
    assert key_cache.data_ptr() == pointer
    assert torch.equal(key_cache[block_table[0, 0], 5], k_new[0])
