"""Graph mode across the library: opcheck for every op, torch.export saved and loaded in a
fresh process, and the plugin path of docs/plugin_path.md (its example file is run here)."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import opmesh

ROOT = Path(__file__).resolve().parents[2]


def samples():
    """Representative inputs for every op in torch.ops.opmesh."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 40, 8, 16, generator=g), torch.randn(2, 50, 2, 16, generator=g)
    w = torch.randn(2, 40, 8, generator=g)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    kc, vc = torch.randn(5, 16, 2, 16, generator=g), torch.randn(5, 16, 2, 16, generator=g)
    sinks = torch.randn(8, generator=g)
    v = torch.randn(2, 50, 2, 16, generator=g)
    out, lse = opmesh.flash_attn(q, k, v, sinks=sinks, mask_mode=3, return_softmax_lse=True)
    qi, ki = torch.randn(2, 40, 4, 8, generator=g), torch.randn(2, 50, 1, 8, generator=g)
    wi = torch.randn(2, 40, 4, generator=g) * 0.2
    m_i, s_i = opmesh.dense_lightning_indexer_softmax_lse(qi, ki, wi)
    stats = lse.reshape(2, 2, 4, 40).transpose(2, 3).contiguous()  # [B, N2, S1, G]
    plan = dict(
        cu_seqlens_q=cu, cu_seqlens_kv=cu, batch_size=2, max_seqlen_q=40, max_seqlen_kv=40,
        layout_q="TND", layout_kv="TND", layout_out="TND", num_workers=3,
    )  # fmt: skip
    out2, lse2 = opmesh.flash_attn(q, k, v, return_softmax_lse=True)
    sel = torch.stack([torch.randperm(50, generator=g)[:6] for _ in range(2 * 40 * 2)])
    sel = sel.view(2, 40, 2, 6).int()
    s_out, s_max, s_sum = opmesh.sparse_flash_attention(q, k, v, sel, 0.25, return_softmax_lse=True)
    ori, cmp = k[:, :, :1], torch.randn(2, 12, 1, 16, generator=g)
    mla = dict(
        ori_kv=ori, cmp_kv=cmp, cmp_ratio=4, cmp_residual_kv=torch.tensor([2, 2]), sinks=sinks,
        ori_win_left=7, ori_win_right=0, softmax_scale=0.25,
    )  # fmt: skip
    m_out, m_lse = opmesh.sparse_flash_mla(q, return_softmax_lse=True, **mla)
    return {
        "merge_attn_states": ((out, lse, out2, lse2), {}),
        "dense_lightning_indexer_grad_kl_loss": (
            (q, k, qi, ki, wi, stats, torch.ones_like(stats), m_i, s_i, 0.25),
            dict(sparse_mode=3, pre_tokens=30),
        ),
        "sparse_lightning_indexer_grad_kl_loss": (
            (q, k, qi, ki, wi, sel[:, :, :1], s_max, s_sum, 0.25),
            dict(sparse_mode=3, pre_tokens=30),
        ),
        "dense_lightning_indexer_softmax_lse": ((q, k, w), dict(sparse_mode=3)),
        "lightning_indexer": ((q, k, w), dict(sparse_count=7, return_value=True)),
        "sparse_flash_attention": (
            (q, k, v, sel, 0.25),
            dict(sinks=sinks, return_softmax_lse=True),
        ),
        "sparse_flash_attention_backward": (
            (torch.randn_like(s_out), q, k, v, sel, s_out, s_max, s_sum, 0.25),
            dict(sparse_mode=0),
        ),
        "sparse_flash_mla": ((q,), dict(mla, return_softmax_lse=True)),
        "sparse_flash_mla_metadata": (
            (8, 1, 16),
            dict(
                batch_size=2,
                max_seqlen_q=40,
                max_seqlen_ori_kv=50,
                max_seqlen_cmp_kv=12,
                cmp_ratio=4,
                cmp_residual_kv=torch.tensor([2, 2]),
                ori_mask_mode=4,
                cmp_mask_mode=3,
                ori_win_left=7,
                ori_win_right=0,
                num_workers=3,
            ),
        ),  # fmt: skip
        "sparse_flash_mla_backward": (
            (torch.randn_like(m_out), q, m_out, m_lse),
            dict(mla, dlse=torch.randn_like(m_lse)),
        ),
        "flash_attn": ((q, k, v), dict(sinks=sinks, mask_mode=3, return_softmax_lse=True)),
        "flash_attn_backward": (
            (torch.randn_like(out), q, k, v, out, lse),
            dict(dlse=torch.randn_like(lse), sinks=sinks, mask_mode=3),
        ),
        "flash_attn_metadata": ((8, 2, 16), plan),
        "flash_attn_metadata_backward": ((8, 2, 16), dict(plan, backward=True)),
        "compressor": (
            (
                torch.randn(2, 9, 12, generator=g),
                torch.randn(16, 12, generator=g),
                torch.randn(16, 12, generator=g),
                torch.zeros(6, 4, 32),
                torch.randn(4, 16, generator=g),
                4,
            ),
            dict(state_block_table=torch.tensor([[1, 2, 3], [4, 5, 0]]), coff=2),
        ),
        "compressor_backward": (
            (
                torch.randn(2, 3, 8, generator=g),
                torch.randn(2, 9, 12, generator=g),
                torch.randn(16, 12, generator=g),
                torch.randn(16, 12, generator=g),
                torch.randn(4, 16, generator=g),
                4,
            ),
            dict(coff=2, seqused=torch.tensor([9, 5])),
        ),
        "kv_cache_write_": (
            (
                torch.randn(3, 2, 16, generator=g),
                torch.randn(3, 2, 16, generator=g),
                kc,
                vc,
                torch.tensor([0, -1, 77]),
            ),
            {},
        ),
    }


def test_opcheck_every_op():
    # Every op the extension registered, read from the dispatcher.
    ops = {
        name.split("::", 1)[1].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("opmesh::")
    }
    cases = samples()
    names = {name.removesuffix("_backward") if "metadata" in name else name for name in cases}
    assert ops == names, f"ops without an opcheck sample: {ops - names}"
    for name, (args, kwargs) in cases.items():
        op = name.removesuffix("_backward") if "metadata" in name else name
        torch.library.opcheck(getattr(torch.ops.opmesh, op).default, args, kwargs)


class SmallAttention(torch.nn.Module):
    """Writes new tokens into a paged cache (buffers), attends over it, and runs the indexer."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.register_buffer("key_cache", torch.randn(8, 16, 2, 32, generator=g))
        self.register_buffer("value_cache", torch.randn(8, 16, 2, 32, generator=g))

    def forward(self, q, k_new, v_new, slots, block_table, seqused_kv, w):
        opmesh.kv_cache_write_(k_new, v_new, self.key_cache, self.value_cache, slots)
        out, lse = opmesh.flash_attn(
            q,
            self.key_cache,
            self.value_cache,
            block_table=block_table,
            seqused_kv=seqused_kv,
            layout_kv="PA_BBND",
            mask_mode=3,
            return_softmax_lse=True,
        )
        m, s = opmesh.dense_lightning_indexer_softmax_lse(q, self.key_cache[:2, :, :1], w)
        return out, lse, m, s


def export_inputs():
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, 1, 8, 32, generator=g),
        torch.randn(2, 2, 32, generator=g),
        torch.randn(2, 2, 32, generator=g),
        torch.tensor([20, 70]),
        torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32),
        torch.tensor([21, 7], dtype=torch.int32),
        torch.randn(2, 1, 8, generator=g),
    )


def test_export_save_load_in_a_fresh_process(tmp_path):
    inputs = export_inputs()
    exported = torch.export.export(SmallAttention(), inputs)
    names = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {
        "opmesh.kv_cache_write_.default",
        "opmesh.flash_attn.default",
        "opmesh.dense_lightning_indexer_softmax_lse.default",
    } <= names, names
    torch.export.save(exported, tmp_path / "attention.pt2")
    eager = SmallAttention()
    want = eager(*inputs)
    torch.save(
        {"inputs": inputs, "want": want, "key_cache": eager.key_cache}, tmp_path / "expected.pt"
    )
    script = textwrap.dedent(f"""
        import torch
        import opmesh  # registers the ops the program calls
        program = torch.export.load({str(tmp_path / "attention.pt2")!r})
        data = torch.load({str(tmp_path / "expected.pt")!r})
        module = program.module()
        got = module(*data["inputs"])
        assert all(torch.equal(a, b) for a, b in zip(got, data["want"])), "outputs differ"
        assert torch.equal(module.key_cache, data["key_cache"]), "cache write differs"
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


def load_plugin_example():
    path = ROOT / "docs" / "examples" / "plugin_op.py"
    spec = importlib.util.spec_from_file_location("plugin_op", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plugin_path_example():
    example = load_plugin_example()
    ns = "opmesh_plugin_example"
    lib = example.define_eager_ops(ns)  # noqa: F841  (keeps the registrations alive)
    ops = getattr(torch.ops, ns)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4)) * 3

    # Before: eager works, a full graph cannot be traced (no fake implementation).
    torch._dynamo.reset()
    with pytest.raises(Exception, match="fake|Meta|meta|abstract"):
        torch.compile(lambda t: ops.rowsum_scale(t, 2.0), fullgraph=True)(x.clone())

    shift = example.make_graph_ready(ns)
    want_x = x.clone()
    want = example.model(ops, shift, want_x)
    torch._dynamo.reset()
    got_x = x.clone()
    got = torch.compile(lambda t: example.model(ops, shift, t), fullgraph=True, dynamic=True)(got_x)
    assert torch.equal(got, want) and torch.equal(got_x, want_x)  # mutations kept
    for op, args in (
        (ops.rowsum_scale.default, (x, 2.0)),
        (ops.clamp_rows_.default, (x.clone(), 1.0)),
        (shift._opoverload, (x.clone(), 0.5)),
    ):
        torch.library.opcheck(op, args)
