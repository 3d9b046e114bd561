"""DeepSeek-V4's operators on real process groups (gloo, spawned processes), run by
test_v4_mesh.py.

A case runs ``sparse_flash_mla`` of one V4 layer kind (SWA: the window alone; HCA: the window
and every compressed entry a row has passed; CSA: the window and a top-k of the compressed
entries) on the mesh and on one device, on the same inputs, and compares the output, the lse and
the gradients of q, the raw keys, the compressed keys and the sinks. Schemes (the mesh's last
axis is the context-parallel one; on a 2-axis mesh the first shards the BSND batch):

* ``dp``: the batch only (BSND);
* ``cp_rep``: the query sequence, raw and compressed keys replicated;
* ``cp_shard``: the query sequence and both key sequences (gathered inside the op);
* ``tnd_dp``: TND tokens of queries, raw keys and compressed keys sharded alike, every shard
  holding whole sequences.

Head-tail order (both orders) permutes the sharded sequences before they are distributed and
the outputs back after. Sizes do not divide the mesh. The compressor runs data parallel; the
layer's compressed keys are gathered once inside ``gather_once()``.
"""

from __future__ import annotations

import contextlib

import torch
from mesh_runner import expect_error as _expect
from torch.distributed.tensor import DTensor

import opmesh
from opmesh import Partial, Replicate, Shard

R = Replicate()
N1, N2, D = 4, 1, 16
RATIO = {"swa": 1, "hca": 4, "csa": 2}
TOP_K = 3
WINDOW = 5


def _selection(rows, entries, seed):
    """A top-k of distinct entries per row ([rows, 1, K] of int32, -1 padded), some past the
    causal frontier (the operator drops those)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((rows, N2, TOP_K), -1, dtype=torch.int32)
    for i in range(rows):
        for n, j in enumerate(torch.randperm(max(entries, 1), generator=g)[:TOP_K].tolist()):
            if j < entries and (i + n) % 4:
                out[i, 0, n] = j
    return out


def _inputs(layout, kind, b, s, q_lens=None, seed=7):
    """q, the raw keys (the same tokens), the compressed entries (every RATIO tokens, the
    residual per sequence), the selection (CSA), sinks and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    r = RATIO[kind]
    if layout == "BSND":
        lead_q, entries = (b, s), s // r
        residual = [s % r] * b
        lead_c = (b, entries)
    else:
        lead_q = (sum(q_lens),)
        entries = [n // r for n in q_lens]
        residual = [n % r for n in q_lens]
        lead_c = (sum(entries),)
    x = dict(
        q=torch.randn(*lead_q, N1, D, generator=g),
        ori_kv=torch.randn(*lead_q, N2, D, generator=g),
        sinks=torch.randn(N1, generator=g),
        gout=torch.randn(*lead_q, N1, D, generator=g),
    )
    call = dict(softmax_scale=0.3, ori_mask_mode=4, ori_win_left=WINDOW - 1, ori_win_right=0)
    if kind != "swa":
        x["cmp_kv"] = torch.randn(*lead_c, N2, D, generator=g)
        call |= dict(cmp_ratio=r, cmp_mask_mode=3, cmp_residual_kv=residual)
    if kind == "csa":
        if layout == "BSND":
            sel = _selection(b * s, entries, seed).view(b, s, N2, TOP_K)
        else:
            pairs = enumerate(zip(q_lens, entries, strict=True))
            sel = torch.cat([_selection(n, e, seed + i) for i, (n, e) in pairs])
        x["cmp_sparse_indices"] = sel
    if layout == "TND":
        cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        call |= dict(layout_q="TND", layout_kv="TND", cu_seqlens_q=cu, cu_seqlens_ori_kv=cu)
        if kind != "swa":
            call["cu_seqlens_cmp_kv"] = [0, *torch.tensor(entries).cumsum(0).tolist()]
    return x, call


GRADS = ("q", "ori_kv", "cmp_kv", "sinks")
QUERY_SIDE = ("q", "gout", "cmp_sparse_indices")


def _attend(x, call):
    """Output, lse and gradients of one sparse_flash_mla call (plain tensors or DTensors)."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in GRADS if n in x}
    tensors = {n: x[n] for n in x if n not in GRADS and n != "gout"}
    out, lse = opmesh.sparse_flash_mla(
        leaves["q"], **{n: v for n, v in leaves.items() if n != "q"}, **tensors, **call,
        return_softmax_lse=True,
    )  # fmt: skip
    loss = (out * x["gout"]).sum() + lse.sum() / 7
    (loss.full_tensor() if isinstance(loss, DTensor) else loss).backward()
    return {"out": out, "lse": lse} | {f"d{n}": v.grad for n, v in leaves.items()}


def _placements(mesh, layout, scheme, name):
    out = [R] * mesh.ndim
    if name == "sinks":
        return out
    seq = 1 if layout == "BSND" else 0
    if scheme == "dp":
        out[0] = Shard(0)
        return out
    if layout == "BSND" and mesh.ndim == 2:
        out[0] = Shard(0)
    if name in QUERY_SIDE or scheme in ("cp_shard", "tnd_dp"):
        out[-1] = Shard(seq)
    return out


def layer_case(mesh, layout, scheme, kind, order=None, b=3, s=13, q_lens=None):
    x, call = _inputs(layout, kind, b, s, q_lens)
    want = _attend(x, call)
    cp = mesh.size(mesh.ndim - 1)
    seq = 1 if layout == "BSND" else 0
    cu = {}
    if layout == "TND":
        cu = {"q": call["cu_seqlens_q"], "ori_kv": call["cu_seqlens_ori_kv"]}
        cu["cmp_kv"] = call.get("cu_seqlens_cmp_kv")
    keys_sharded = scheme == "cp_shard"

    def to_order(name, value, back=False):
        if order is None or (name not in QUERY_SIDE and not keys_sharded) or name == "sinks":
            return value
        side = name if name in ("ori_kv", "cmp_kv") else "q"
        move = opmesh.from_head_tail if back else opmesh.to_head_tail
        return move(value, seq, cp, order, cu_seqlens=cu.get(side))

    dx = {
        n: opmesh.distribute_tensor(to_order(n, v), mesh, _placements(mesh, layout, scheme, n))
        for n, v in x.items()
    }
    block = contextlib.nullcontext() if order is None else opmesh.head_tail_cp(order)
    with block, opmesh.gather_once():
        got = _attend(dx, call)
    for name, value in got.items():
        assert isinstance(value, DTensor), f"{name}: not a DTensor"
        full = value.full_tensor()
        if name == "dsinks":  # every scheme splits the rows
            assert any(isinstance(p, Partial) for p in value.placements), value.placements
        side = {"out": "q", "lse": "q", "dq": "q", "dori_kv": "ori_kv", "dcmp_kv": "cmp_kv"}
        if name in side and full.dim() > 1:
            dim = 2 if name == "lse" and layout == "BSND" else 1 if name == "lse" else seq
            if name == "lse":
                full = _lse_back(full, dim, cp, order, cu.get("q")) if order else full
            else:
                full = to_order(side[name], full, back=True)
        _compare(name, full, want[name])


def _lse_back(lse, dim, cp, order, cu):
    return opmesh.from_head_tail(lse, dim, cp, order, cu_seqlens=cu)


def _compare(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: infinities differ"
    scale = want[finite].abs().max().item() + 1e-12 if finite.any() else 1.0
    worst = (got[finite] - want[finite]).abs().max().item() / scale if finite.any() else 0.0
    assert worst <= 1e-5, f"{name}: error {worst:.2e} of the largest entry > 1e-5"


def _dp_lengths(cp):
    """TND sequences whose token boundaries (queries and raw keys alike) and compressed-entry
    boundaries (every 4 tokens) fall on every shard boundary: per rank 12 tokens, 3 entries."""
    per_rank = [[4, 8], [12], [8, 0, 4]]
    out = []
    for i in range(cp):
        out += per_rank[i % 3]
    return out


def compressor_case(mesh, b=5):
    """The compressor data parallel: x sharded on the batch over the first axis (a one-axis mesh:
    its axis), entries and gradients of x and the shared weights equal one device; sharded
    tokens and a state cache are refused by name."""
    g = torch.Generator().manual_seed(11)
    s, h, d, r = 11, 24, 8, 4
    used = [11, 9, 0, 4, 11][:b]
    x = torch.randn(b, s, h, generator=g)
    w = {n: torch.randn(2 * d, h, generator=g) / 4 for n in ("wkv", "wgate")}
    ape = torch.randn(r, 2 * d, generator=g)
    up = torch.randn(b, -(-s // r), d, generator=g)
    leaves = [x, w["wkv"], w["wgate"], ape]
    ref = [t.clone().requires_grad_() for t in leaves]
    want = opmesh.compressor(ref[0], ref[1], ref[2], None, ref[3], r, coff=2, seqused=used)
    (want * up).sum().backward()
    batch = [R] * mesh.ndim
    batch[0] = Shard(0)
    placements = [batch, [R] * mesh.ndim, [R] * mesh.ndim, [R] * mesh.ndim]
    dist = [
        opmesh.distribute_tensor(t, mesh, pl).requires_grad_()
        for t, pl in zip(leaves, placements, strict=True)
    ]
    with opmesh.gather_once():
        got = opmesh.compressor(dist[0], dist[1], dist[2], None, dist[3], r, coff=2,
                                seqused=used)  # fmt: skip
    dup = opmesh.distribute_tensor(up, mesh, batch)
    (got * dup).sum().full_tensor().backward()
    _compare("compressor", got.full_tensor(), want)
    for name, a, b_ in zip(("dx", "dwkv", "dwgate", "dape"), dist, ref, strict=True):
        _compare(name, a.grad.full_tensor(), b_.grad)
    tokens = [R] * mesh.ndim
    tokens[-1] = Shard(1)
    sharded = opmesh.distribute_tensor(x, mesh, tokens)
    _expect(
        ValueError, "x: dim 1", lambda: opmesh.compressor(sharded, *dist[1:3], None, dist[3], r)
    )
    _expect(
        ValueError, "state_cache",
        lambda: opmesh.compressor(dist[0], *dist[1:3], torch.zeros(2, 8, 4 * d), dist[3], r,
                                  state_block_table=[[1]] * b, coff=2),
    )  # fmt: skip
    _expect(
        ValueError, "projections",
        lambda: opmesh.compressor(dist[0], *dist[1:3], None, dist[3], r, coff=2,
                                  projections=torch.zeros(*x.shape[:-1], 4 * d)),
    )  # fmt: skip


def errors_case(mesh):
    x, call = _inputs("BSND", "hca", 2, 8)
    q = opmesh.distribute_tensor(x["q"], mesh, _placements(mesh, "BSND", "cp_rep", "q"))
    kv = opmesh.distribute_tensor(x["ori_kv"], mesh, _placements(mesh, "BSND", "cp_rep", "kv"))
    cmp = opmesh.distribute_tensor(x["cmp_kv"], mesh, _placements(mesh, "BSND", "cp_rep", "kv"))
    meta = opmesh.sparse_flash_mla_metadata(N1, N2, D, batch_size=2, max_seqlen_q=8,
                                            max_seqlen_ori_kv=8, max_seqlen_cmp_kv=2)  # fmt: skip
    _expect(ValueError, "metadata", lambda: opmesh.sparse_flash_mla(q, ori_kv=kv, metadata=meta))
    scale = torch.ones(x["ori_kv"].shape[:-1])
    _expect(
        ValueError, "ori_kv_scale: a quantized kv is read on one device",
        lambda: opmesh.sparse_flash_mla(q, ori_kv=kv, ori_kv_scale=scale),
    )  # fmt: skip
    _expect(
        ValueError, "ori_win_right",
        lambda: opmesh.sparse_flash_mla(q, ori_kv=kv, ori_mask_mode=4, ori_win_left=3),
    )  # fmt: skip
    heads = opmesh.distribute_tensor(x["q"], mesh, [R] * (mesh.ndim - 1) + [Shard(2)])
    _expect(ValueError, "q: dim 2 (N1)", lambda: opmesh.sparse_flash_mla(heads, ori_kv=kv))
    plain = x["cmp_kv"]
    _expect(ValueError, "cmp_kv: expected a DTensor",
            lambda: opmesh.sparse_flash_mla(q, ori_kv=kv, cmp_kv=plain, cmp_ratio=4))  # fmt: skip
    assert cmp.shape == plain.shape


def _csa_step(x, r, cached):
    """One CSA layer step on sequence-sharded keys: the indexer over its compressed keys, the
    attention over the window and the picked entries, and the sparse KL loss (the attention's
    entries and statistics as its target), forward and backward; returns the gradients."""
    names = ("q", "ori_kv", "cmp_kv", "qi", "ki", "w")
    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    block = opmesh.gather_once() if cached else contextlib.nullcontext()
    cmp = dict(cmp_ratio=r, cmp_residual_key=x["residual"])
    with block:
        picked = opmesh.lightning_indexer(
            leaves["qi"], leaves["ki"], leaves["w"], sparse_count=TOP_K, **cmp
        )[0]
        out, lse = opmesh.sparse_flash_mla(
            leaves["q"], ori_kv=leaves["ori_kv"], cmp_kv=leaves["cmp_kv"],
            cmp_sparse_indices=picked, softmax_scale=0.3, cmp_ratio=r,
            cmp_residual_kv=x["residual"], ori_win_left=WINDOW - 1,
            ori_win_right=0, return_softmax_lse=True,
        )  # fmt: skip
        loss = opmesh.sparse_indexer_kl_loss(
            leaves["qi"], leaves["ki"], leaves["w"], leaves["q"].detach(),
            leaves["cmp_kv"].detach(), picked, lse.detach(), torch.ones_like(lse), 0.3, **cmp,
        )  # fmt: skip
        total = (out * x["gout"]).sum() + loss.sum()
    total.full_tensor().backward()
    return {n: v.grad for n, v in leaves.items()}


def one_gather_per_layer_case(mesh):
    """Inside gather_once(), a CSA layer step gathers each sharded key tensor once forward (the
    raw keys, the compressed entries shared by the attention and the KL loss, the indexer's
    compressed keys shared by the indexer and the KL loss) and reduce-scatters each gradient
    once backward; without the block each op gathers its own; the gradients are the same."""
    from torch.distributed.tensor.debug import CommDebugMode

    g = torch.Generator().manual_seed(13)
    b, s, r = 2, 13, 2
    c = s // r
    x = dict(
        q=torch.randn(b, s, N1, D, generator=g), ori_kv=torch.randn(b, s, N2, D, generator=g),
        cmp_kv=torch.randn(b, c, N2, D, generator=g), qi=torch.randn(b, s, 2, 8, generator=g),
        ki=torch.randn(b, c, 1, 8, generator=g), w=torch.randn(b, s, 2, generator=g),
        gout=torch.randn(b, s, N1, D, generator=g),
    )  # fmt: skip
    seq = [R] * (mesh.ndim - 1) + [Shard(1)]
    dx = {n: opmesh.distribute_tensor(v, mesh, seq) for n, v in x.items()}
    dx["residual"] = [s % r] * b
    counts, grads = {}, {}
    for mode in ("plain", "cached"):
        with CommDebugMode() as comm:
            grads[mode] = _csa_step(dx, r, mode == "cached")
        table = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        counts[mode] = (
            table.get("all_gather_into_tensor", 0),
            table.get("reduce_scatter_tensor", 0),
        )
    # Gathers: ki (indexer, KL), ori_kv (attention), cmp_kv (attention, KL). The KL loss takes
    # detached keys: their gradients come from the indexer and the attention alone.
    assert counts["plain"] == (5, 3), f"without the block: {counts}"
    assert counts["cached"] == (3, 3), f"with gather_once: {counts}"
    for name, grad in grads["plain"].items():
        _compare(f"cached {name}.grad", grads["cached"][name].full_tensor(), grad.full_tensor())


def v4_cases(mesh):
    cp = mesh.size(mesh.ndim - 1)
    varlen = dict(q_lens=[9, 0, 23, 17, 15])
    ht = dict(q_lens=[8 * cp, 0, 16 * cp])  # every sequence's entries a multiple of 2 cp too
    cases = {}
    for kind in ("swa", "hca", "csa"):
        cases[f"{kind}_bsnd_dp"] = lambda k=kind: layer_case(mesh, "BSND", "dp", k)
        for scheme in ("cp_rep", "cp_shard"):
            cases[f"{kind}_bsnd_{scheme}"] = lambda k=kind, sc=scheme: layer_case(
                mesh, "BSND", sc, k
            )
            cases[f"{kind}_tnd_{scheme}"] = lambda k=kind, sc=scheme: layer_case(
                mesh, "TND", sc, k, **varlen
            )
        cases[f"{kind}_tnd_dp"] = lambda k=kind: layer_case(
            mesh, "TND", "tnd_dp", k, q_lens=_dp_lengths(cp)
        )
        for order in ("opmesh", "hyperparallel"):
            cases[f"{kind}_bsnd_head_tail_{order}"] = lambda k=kind, o=order: layer_case(
                mesh, "BSND", "cp_shard", k, o, b=2, s=8 * cp
            )
            cases[f"{kind}_tnd_head_tail_{order}"] = lambda k=kind, o=order: layer_case(
                mesh, "TND", "cp_shard", k, o, **ht
            )
    for kind in ("swa", "csa"):  # two tokens over the mesh: ranks with empty shards of all
        cases[f"{kind}_empty_shards"] = lambda k=kind: layer_case(
            mesh, "BSND", "cp_shard", k, b=2, s=2
        )
    cases["compressor_data_parallel"] = lambda: compressor_case(mesh)
    cases["compressor_empty_batch_shards"] = lambda: compressor_case(mesh, b=1)
    cases["errors"] = lambda: errors_case(mesh)
    cases["one_gather_per_layer"] = lambda: one_gather_per_layer_case(mesh)
    return cases


CASE_NAMES = [
    f"{kind}_{name}"
    for kind in ("swa", "hca", "csa")
    for name in (
        "bsnd_dp",
        "bsnd_cp_rep",
        "bsnd_cp_shard",
        "tnd_cp_rep",
        "tnd_cp_shard",
        "tnd_dp",
        "bsnd_head_tail_opmesh",
        "bsnd_head_tail_hyperparallel",
        "tnd_head_tail_opmesh",
        "tnd_head_tail_hyperparallel",
    )  # fmt: skip
] + [
    "swa_empty_shards",
    "csa_empty_shards",
    "compressor_data_parallel",
    "compressor_empty_batch_shards",
    "errors",
    "one_gather_per_layer",
]
