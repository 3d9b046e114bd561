"""The kernel layer seen from Python: which sets exist, the amx_bf16 level on AMX tiles or their
portable emulation, and that every set gives the float64 reference's answer on shapes that leave
partial tiles (rows, head dims and key counts that are not multiples of the AMX tile)."""

import pytest
import torch
from attention_reference import flash_attn_reference
from conftest import assert_raises_named
from reference import indexer_softmax_lse as indexer_reference

import opmesh

HAS_BF16 = "avx512_bf16" in opmesh.simd_levels()
HAS_AMX = opmesh.kernel_sets()["amx_tiles"] == "hardware"


def test_every_listed_set_is_usable_and_declares_its_geometry():
    info = opmesh.kernel_sets()
    names = [s["name"] for s in info["sets"]]
    assert names[0] == "scalar"
    levels = opmesh.simd_levels()
    for s in info["sets"]:
        assert s["isa"] in levels
        assert s["word"] in ("float32", "bf16_pair")
        assert s["depth_align"] >= 1 and s["row_align"] >= 1
    assert ("avx512_bf16/pairs" in names) == HAS_BF16
    assert info["amx_tiles"] in ("hardware", "none")


def test_amx_emulation_is_only_there_when_asked(monkeypatch):
    monkeypatch.setenv("OPMESH_AMX_TILES", "emulate")
    info = opmesh.kernel_sets()
    if not HAS_BF16:
        assert info["amx_tiles"] == "none" and "amx_bf16" not in opmesh.simd_levels()
        return
    assert info["amx_tiles"] == "emulated"
    amx = [s for s in info["sets"] if s["isa"] == "amx_bf16"]
    assert [s["name"] for s in amx] == ["amx_bf16/emulated"]
    assert amx[0]["depth_align"] == 16 and amx[0]["row_align"] == 16
    assert opmesh.active_simd_level() == "amx_bf16"


def test_bad_tile_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("OPMESH_AMX_TILES", "always")
    assert_raises_named(ValueError, "OPMESH_AMX_TILES", opmesh.kernel_sets)
    q = torch.randn(1, 3, 2, 8)
    assert_raises_named(ValueError, "OPMESH_AMX_TILES", lambda: opmesh.flash_attn(q, q, q))


@pytest.mark.skipif(
    not HAS_AMX,
    reason="this CPU (or its OS) gives no AMX tiles: CPUID AMX-TILE "
    "and AMX-BF16, XCR0 tile state and arch_prctl permission are all required",
)
def test_amx_hardware_is_the_default_for_bf16(monkeypatch):
    monkeypatch.delenv("OPMESH_AMX_TILES", raising=False)
    monkeypatch.setenv("OPMESH_BF16_KERNELS", "pairs")
    assert opmesh.active_simd_level() == "amx_bf16"
    assert opmesh.bf16_kernels()["compute"]["kernel_set"] == "amx_bf16/tiles"


@pytest.mark.parametrize(
    "rows,dim,dim_v,keys",
    [(1, 8, 8, 1), (5, 72, 40, 65), (17, 130, 130, 200), (33, 256, 96, 129), (63, 64, 64, 64)],
)
def test_amx_paths_agree_with_the_reference_on_partial_tiles(rows, dim, dim_v, keys, simd_level):
    """Shapes chosen so the 16-row, 32-element AMX tiles are never full: the padding rows and
    depth words must not leak into the result. Runs on every kernel path of this machine."""
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    q = torch.randn(2, rows, 6, dim, generator=g).bfloat16()
    k = torch.randn(2, keys, 2, dim, generator=g).bfloat16()
    v = torch.randn(2, keys, 2, dim_v, generator=g).bfloat16()
    out, lse = opmesh.flash_attn(q, k, v, mask_mode=3, return_softmax_lse=True)
    ref, ref_lse = flash_attn_reference(q, k, v, mask_mode=3)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    visible = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[visible], ref_lse[visible], atol=1e-3, rtol=1e-3)
    w = torch.randn(2, rows, 6, generator=g).bfloat16()
    m, s = opmesh.dense_lightning_indexer_softmax_lse(q, k, w)
    rm, rs = indexer_reference(q, k, w)
    fin = torch.isfinite(rm)
    torch.testing.assert_close(m[fin].double(), rm[fin], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(s[fin].double(), rs[fin], atol=1e-3, rtol=1e-4)
