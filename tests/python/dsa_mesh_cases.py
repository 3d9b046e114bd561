"""The DSA operators on real process groups (gloo, spawned processes), run by test_dsa_mesh.py.

One case runs a whole DSA layer on the mesh and on one device, on the same inputs: the dense
indexer's statistics, the dense KL loss and its gradients, lightning_indexer's selection,
sparse_flash_attention forward and backward (on the mesh's own selection), the sparse KL loss
and its gradients, and the fused sparse operator. Schemes (the mesh's last axis is the
context-parallel one; a 2-axis mesh's first shards the BSND batch):

* ``dp``: the batch only (BSND);
* ``cp_rep``: the query sequence, keys replicated;
* ``cp_shard``: the query and key sequences (keys gathered inside the ops);
* ``cp_two_axes``: both sequences over both axes of a 2-axis mesh;
* ``tnd_dp``: TND tokens of queries and keys sharded alike, every shard holding whole sequences.

Head-tail order (both orders) permutes the sharded sequences before they are distributed and
the outputs back after. Sizes do not divide the mesh.
"""

from __future__ import annotations

import contextlib

import torch
from mesh_runner import expect_error as _expect
from torch.distributed.tensor import DTensor

import opmesh
from opmesh import Partial, Replicate, Shard

R = Replicate()
TOP_K = 5
SCALE = 0.25
N1, N2, D, DR = 4, 2, 16, 8  # main attention: 4 query heads over 2 key heads
NI = 4  # indexer query heads (one index key head)

# Per tensor: (side, BSND sequence dim, TND sequence dim); None for replicated tensors.
SEQ = {
    "query_index": ("q", 1, 0),
    "weights": ("q", 1, 0),
    "query": ("q", 1, 0),
    "query_rope": ("q", 1, 0),
    "sparse_indices": ("q", 1, 0),
    "main_max": ("q", 2, 1),
    "main_sum": ("q", 2, 1),
    "gout": ("q", 1, 0),
    "key_index": ("k", 1, 0),
    "key": ("k", 1, 0),
    "value": ("k", 1, 0),
    "key_rope": ("k", 1, 0),
}
STATS_SEQ = {"BSND": 2, "TND": 1}  # the statistics' query sequence dim ([B, N, S1(, G)])


def _inputs(layout, b, s1, s2, q_lens=None, k_lens=None, seed=3):
    g = torch.Generator().manual_seed(seed)
    lead_q = (b, s1) if layout == "BSND" else (sum(q_lens),)
    lead_k = (b, s2) if layout == "BSND" else (sum(k_lens),)
    x = dict(
        query_index=torch.randn(*lead_q, NI, D, generator=g),
        key_index=torch.randn(*lead_k, 1, D, generator=g),
        weights=torch.randn(*lead_q, NI, generator=g) / 4,
        query=torch.randn(*lead_q, N1, D, generator=g),
        key=torch.randn(*lead_k, N2, D, generator=g),
        value=torch.randn(*lead_k, N2, D, generator=g),
        query_rope=torch.randn(*lead_q, N1, DR, generator=g),
        key_rope=torch.randn(*lead_k, N2, DR, generator=g),
        gout=torch.randn(*lead_q, N1, D, generator=g),
        sinks=torch.randn(N1, generator=g),
    )
    stats = (b, N2, s1, N1 // N2) if layout == "BSND" else (N2, lead_q[0], N1 // N2)
    x["main_max"] = torch.randn(*stats, generator=g)
    x["main_sum"] = torch.rand(*stats, generator=g) + 0.5
    return x


def _lengths(layout, b, q_lens, k_lens):
    """The lengths in the dense family's names and in the sparse operators' names."""
    if layout == "BSND":
        if q_lens is None:
            return {}, {}, {}
        ql, kl = torch.tensor(q_lens), torch.tensor(k_lens)
    else:
        ql, kl = torch.tensor(q_lens).cumsum(0), torch.tensor(k_lens).cumsum(0)
    dense = dict(actual_seq_qlen=ql, actual_seq_klen=kl, layout=layout)
    indexer = dict(actual_seq_lengths_query=ql, actual_seq_lengths_key=kl, layout_query=layout)
    indexer["layout_key"] = layout
    attention = dict(actual_seq_lengths_query=ql, actual_seq_lengths_kv=kl, layout_query=layout)
    attention["layout_kv"] = layout
    return dense, indexer, attention


def _layer(x, layout, dense_kw, indexer_kw, attention_kw, mode, cmp=None):
    """One DSA layer's outputs and gradients; ``x`` holds plain tensors or DTensors. ``cmp``:
    compressed keys (``cmp_ratio``, ``cmp_residual_key``) for the indexers and the KL losses,
    whose main statistics are then the inputs' (sparse attention takes no compressed keys)."""
    out = {}
    mask = dict(sparse_mode=mode, **(cmp or {}))
    stats = opmesh.dense_lightning_indexer_softmax_lse(
        x["query_index"], x["key_index"], x["weights"], **dense_kw, **mask
    )
    out["dense_max"], out["dense_sum"] = stats
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("query_index", "key_index")}
    leaves["weights"] = x["weights"].detach().clone().requires_grad_()
    main = {n: x[n] for n in ("query", "key")}
    ropes = dict(query_rope=x["query_rope"], key_rope=x["key_rope"])
    loss = opmesh.indexer_kl_loss(
        *leaves.values(), **main, softmax_max=x["main_max"], softmax_sum=x["main_sum"],
        scale_value=SCALE, **ropes, **dense_kw, **mask,
    )  # fmt: skip
    _backward(loss)
    out["dense_loss"] = loss
    out.update({f"dense_grad_{n}": v.grad for n, v in leaves.items()})
    # scale_value reaches the ranks' calls by its declared name alone (the values would differ
    # by its factor otherwise).
    indices, values = opmesh.lightning_indexer(
        x["query_index"], x["key_index"], x["weights"], sparse_count=TOP_K, return_value=True,
        scale_value=0.5, **indexer_kw, **mask,
    )  # fmt: skip
    out["indices"], out["index_values"] = indices, values
    if cmp is None:
        attn = {n: x[n].detach().clone().requires_grad_() for n in ("query", "key", "value")}
        attn.update({n: x[n].detach().clone().requires_grad_() for n in ("query_rope", "key_rope")})
        attn["sinks"] = x["sinks"].detach().clone().requires_grad_()
        o, smax, ssum = opmesh.sparse_flash_attention(
            attn["query"], attn["key"], attn["value"], indices, SCALE,
            query_rope=attn["query_rope"], key_rope=attn["key_rope"], sinks=attn["sinks"],
            return_softmax_lse=True, **attention_kw, **mask,
        )  # fmt: skip
        _backward((o * x["gout"]).sum())
        out["attention"], out["softmax_max"], out["softmax_sum"] = o, smax, ssum
        out.update({f"attention_grad_{n}": v.grad for n, v in attn.items()})
    else:
        smax, ssum = x["main_max"], x["main_sum"]
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("query_index", "key_index")}
    leaves["weights"] = x["weights"].detach().clone().requires_grad_()
    loss = opmesh.sparse_indexer_kl_loss(
        *leaves.values(), x["query"], x["key"], indices, smax, ssum, SCALE, **ropes, **dense_kw,
        **mask,
    )  # fmt: skip
    _backward(loss)
    out["sparse_loss"] = loss
    out.update({f"sparse_grad_{n}": v.grad for n, v in leaves.items()})
    fused = opmesh.sparse_lightning_indexer_grad_kl_loss(
        x["query"], x["key"], x["query_index"], x["key_index"], x["weights"], indices, smax,
        ssum, SCALE, **ropes, **dense_kw, **mask,
    )  # fmt: skip
    for name, value in zip(("dq", "dk", "dw", "loss"), fused, strict=True):
        out[f"fused_{name}"] = value
    return out


def _backward(loss):
    (loss.full_tensor() if isinstance(loss, DTensor) else loss).sum().backward()


# Where each output's (or gradient's) sequence dim is, and on which side.
OUTPUT_SEQ = {
    "dense_max": "stats",
    "dense_sum": "stats",
    "dense_grad_query_index": "query_index",
    "dense_grad_key_index": "key_index",
    "dense_grad_weights": "weights",
    "indices": "query",
    "index_values": "query",
    "attention": "query",
    "softmax_max": "main_max",
    "softmax_sum": "main_max",
    "attention_grad_query": "query",
    "attention_grad_key": "key",
    "attention_grad_value": "value",
    "attention_grad_query_rope": "query",
    "attention_grad_key_rope": "key",
    "sparse_grad_query_index": "query_index",
    "sparse_grad_key_index": "key_index",
    "sparse_grad_weights": "weights",
    "fused_dq": "query_index",
    "fused_dk": "key_index",
    "fused_dw": "weights",
}


def _placements(mesh, layout, scheme, name):
    """The placements of tensor ``name`` under ``scheme``."""
    if name not in SEQ:
        return [R] * mesh.ndim  # sinks
    side, bsnd_dim, tnd_dim = SEQ[name]
    seq = bsnd_dim if layout == "BSND" else tnd_dim
    out = [R] * mesh.ndim
    if scheme == "dp":
        out[0] = Shard(0)
        return out
    if scheme == "tnd_dp_first_axis":  # tokens over the first ("dp") axis, keys alike
        out[0] = Shard(seq)
        return out
    if layout == "BSND" and mesh.ndim == 2 and scheme != "cp_two_axes":
        out[0] = Shard(0)
    keys_sharded = scheme in ("cp_shard", "cp_two_axes", "tnd_dp")
    if side == "q" or keys_sharded:
        if scheme == "cp_two_axes":
            out = [Shard(seq)] * mesh.ndim
        else:
            out[-1] = Shard(seq)
    return out


def _seq_dim(layout, name):
    if name == "stats":
        return STATS_SEQ[layout]
    side, bsnd_dim, tnd_dim = SEQ[name]
    return bsnd_dim if layout == "BSND" else tnd_dim


def dsa_layer_case(mesh, layout, scheme, order=None, mode=3, b=3, s1=13, s2=17, q_lens=None,
                   k_lens=None, cached=False, cmp=None, softcap=None,
                   placements=True):  # fmt: skip
    """The DSA layer on the mesh equals the one-device layer: outputs, statistics, indices,
    losses and gradients (full tensors, in natural order); ``cached``: the whole layer in one
    ``gather_once()`` block. ``placements``: also check the scheme's placements of the losses
    and of the fused key gradient (random lengths may put every sequence whole on one shard,
    where TND takes the data-parallel path)."""
    x = _inputs(layout, b, s1, s2, q_lens, k_lens)
    dense_kw, indexer_kw, attention_kw = _lengths(layout, b, q_lens, k_lens)
    if softcap is not None:
        attention_kw["softcap"] = softcap
    want = _layer(x, layout, dense_kw, indexer_kw, attention_kw, mode, cmp)
    cp = mesh.size() if scheme == "cp_two_axes" else mesh.size(mesh.ndim - 1)
    keys_sharded = scheme in ("cp_shard", "cp_two_axes")
    cu = {}
    if layout == "TND":
        cu = {"q": [0, *torch.tensor(q_lens).cumsum(0).tolist()]}
        cu["k"] = [0, *torch.tensor(k_lens).cumsum(0).tolist()]

    def to_order(name, value, back=False):
        if order is None or name not in SEQ and name != "stats":
            return value
        side = "q" if name == "stats" else SEQ[name][0]
        if side == "k" and not keys_sharded:
            return value
        move = opmesh.from_head_tail if back else opmesh.to_head_tail
        return move(
            value, _seq_dim(layout, name), cp, order, cu_seqlens=cu.get(side) if cu else None
        )

    dx = {
        n: opmesh.distribute_tensor(to_order(n, v), mesh, _placements(mesh, layout, scheme, n))
        for n, v in x.items()
    }
    order_block = contextlib.nullcontext() if order is None else opmesh.head_tail_cp(order)
    gather_block = opmesh.gather_once() if cached else contextlib.nullcontext()
    with order_block, gather_block:
        got = _layer(dx, layout, dense_kw, indexer_kw, attention_kw, mode, cmp)
    row_axes = set()
    q_placements = _placements(mesh, layout, scheme, "query")
    for axis, placement in enumerate(q_placements):
        if isinstance(placement, Shard):
            row_axes.add(axis)
    for name, value in got.items():
        assert isinstance(value, DTensor), f"{name}: not a DTensor ({type(value).__name__})"
        full = value.full_tensor()
        if name.endswith("loss") and placements:
            expect = [isinstance(p, Partial) for p in value.placements]
            assert expect == [a in row_axes for a in range(mesh.ndim)], (
                f"{name}: placements {value.placements}"
            )
        elif name in OUTPUT_SEQ and full.dim() > 1:
            full = to_order(OUTPUT_SEQ[name], full, back=True)
        if (
            name == "fused_dk"
            and placements
            and scheme not in ("dp", "tnd_dp", "tnd_dp_first_axis")
        ):
            assert isinstance(value.placements[-1], Partial), f"{name}: {value.placements}"
        _compare(name, full, want[name])


def _compare(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if not got.is_floating_point():
        assert torch.equal(got, want), f"{name}: differs in {(got != want).sum().item()} entries"
        return
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: infinities differ"
    scale = want[finite].abs().max().item() + 1e-12 if finite.any() else 1.0
    worst = (got[finite] - want[finite]).abs().max().item() / scale if finite.any() else 0.0
    assert worst <= 1e-5, f"{name}: error {worst:.2e} of the largest entry > 1e-5"


def _whole_sequence_lengths(total, shards, split, empty=False):
    """Sequence lengths whose boundaries include every shard boundary of ``total`` tokens split
    ``shards`` ways (DTensor's split), each shard cut in two at ``split`` of its size."""
    chunk = -(-total // shards)
    out = []
    for i in range(shards):
        size = max(0, min(total, (i + 1) * chunk) - i * chunk)
        a = int(size * split)
        out += [a, size - a] + ([0] if empty and i == 0 else [])
    return out


def case_errors(mesh):
    """Errors name the tensor, the dim and the mesh axis; paged keys are refused."""
    x = _inputs("BSND", 2, 8, 8)
    last = mesh.ndim - 1
    axis = mesh.mesh_dim_names[last]
    rest = [R] * last

    def dist(name, placements):
        return opmesh.distribute_tensor(x[name], mesh, placements)

    q = dist("query_index", rest + [Shard(1)])
    w = dist("weights", rest + [Shard(1)])
    _expect(
        ValueError,
        f"key: dim 2 (N2) is sharded over mesh axis '{axis}'; it must be replicated",
        lambda: opmesh.lightning_indexer(q, dist("key_index", rest + [Shard(2)]), w),
    )
    _expect(
        ValueError,
        f"query: dim 3 (D) is sharded over mesh axis '{axis}'",
        lambda: opmesh.lightning_indexer(
            dist("query_index", rest + [Shard(3)]), dist("key_index", rest + [R]), w
        ),
    )
    k = dist("key_index", rest + [R])
    indices = opmesh.lightning_indexer(q, k, w, sparse_count=3)[0]
    assert isinstance(indices, DTensor) and indices.placements[-1] == Shard(1)
    bad_indices = opmesh.distribute_tensor(indices.full_tensor(), mesh, rest + [Shard(3)])
    main = {n: dist(n, rest + [R]) for n in ("key", "value")}
    query = dist("query", rest + [Shard(1)])
    _expect(
        ValueError,
        f"sparse_indices: dim 3 (K) is sharded over mesh axis '{axis}'; it must be replicated",
        lambda: opmesh.sparse_flash_attention(query, *main.values(), bad_indices, SCALE),
    )
    replicated_indices = opmesh.distribute_tensor(indices.full_tensor(), mesh, rest + [R])
    _expect(
        ValueError,
        "sparse_indices: dim 1 (S1) is not sharded; the query sequence must be sharded like",
        lambda: opmesh.sparse_flash_attention(query, *main.values(), replicated_indices, SCALE),
    )
    _expect(
        ValueError,
        "layout_kv: paged keys (PA_BSND) are not supported on a device mesh",
        lambda: opmesh.sparse_flash_attention(
            query, *main.values(), indices, SCALE, layout_kv="PA_BSND", block_table=[[0]]
        ),
    )
    scales = torch.ones(main["key"].shape[:-1])
    _expect(
        ValueError,
        "key_scale: a quantized key and value are read on one device",
        lambda: opmesh.sparse_flash_attention(
            query, *main.values(), indices, SCALE, key_scale=scales, value_scale=scales
        ),
    )
    _expect(
        ValueError,
        "layout_key: paged keys (PA_BSND) are not supported on a device mesh",
        lambda: opmesh.lightning_indexer(q, k, w, layout_key="PA_BSND", block_table=[[0]]),
    )
    if mesh.ndim == 2:
        # keys sharded over another axis than the query's
        other = [Shard(1), R]
        _expect(
            ValueError,
            "key: dim 1 (S2) is sharded over mesh axis",
            lambda: opmesh.lightning_indexer(q, dist("key_index", other), w),
        )
    _expect(
        ValueError,
        "key: dim 1 (S2) is sharded over mesh axis",
        lambda: opmesh.lightning_indexer(
            dist("query_index", [R] * mesh.ndim),
            dist("key_index", rest + [Shard(1)]),
            dist("weights", [R] * mesh.ndim),
        ),
    )


def dsa_cases(mesh):
    cp = mesh.size(mesh.ndim - 1)
    ht_q = [4 * cp, 0, 2 * cp * 3]
    ht_k_sharded = [4 * cp, 2 * cp, 8 * cp]
    ht_k_rep = [4 * cp + 1, 3, 6 * cp + 5]
    varlen = dict(q_lens=[9, 0, 23, 17, 15], k_lens=[9, 4, 40, 17, 30])
    t1, t2 = 3 * cp + 1, 4 * cp + 3
    dp_lens = dict(
        q_lens=_whole_sequence_lengths(t1, cp, 0.5, empty=True),
        k_lens=_whole_sequence_lengths(t2, cp, 0.4, empty=True),
    )
    cmp_bsnd = dict(cmp_ratio=4, cmp_residual_key=[1, 3, 0])  # 17, 19 and 16 tokens
    tnd_cmp = dict(q_lens=[9, 0, 23, 17], k_lens=[3, 1, 6, 5])
    cmp_tnd = dict(cmp_ratio=4, cmp_residual_key=[1, 0, 0, 2])  # 13, 4, 24 and 22 tokens
    cases = {
        "bsnd_dp": lambda: dsa_layer_case(mesh, "BSND", "dp"),
        "bsnd_cp_rep": lambda: dsa_layer_case(mesh, "BSND", "cp_rep"),
        "bsnd_cp_shard": lambda: dsa_layer_case(mesh, "BSND", "cp_shard"),
        "bsnd_cp_shard_lengths": lambda: dsa_layer_case(
            mesh, "BSND", "cp_shard", q_lens=[13, 9, 2], k_lens=[17, 12, 6]
        ),
        "bsnd_cp_shard_mode0": lambda: dsa_layer_case(mesh, "BSND", "cp_shard", mode=0),
        # A softcap that binds (scores beyond 0.7), on sequences that do not divide the mesh.
        "bsnd_cp_shard_softcap": lambda: dsa_layer_case(mesh, "BSND", "cp_shard", softcap=0.7),
        "tnd_cp_rep_softcap": lambda: dsa_layer_case(mesh, "TND", "cp_rep", softcap=0.7, **varlen),
        "bsnd_head_tail_opmesh_shard": lambda: dsa_layer_case(
            mesh, "BSND", "cp_shard", "opmesh", s1=4 * cp, s2=6 * cp
        ),
        "bsnd_head_tail_hyperparallel_shard": lambda: dsa_layer_case(
            mesh, "BSND", "cp_shard", "hyperparallel", b=2, s1=4 * cp, s2=6 * cp
        ),
        "bsnd_head_tail_hyperparallel_rep": lambda: dsa_layer_case(
            mesh, "BSND", "cp_rep", "hyperparallel", s1=4 * cp, s2=4 * cp + 3
        ),
        "tnd_cp_rep": lambda: dsa_layer_case(mesh, "TND", "cp_rep", **varlen),
        "tnd_cp_shard": lambda: dsa_layer_case(mesh, "TND", "cp_shard", **varlen),
        "tnd_head_tail_opmesh_shard": lambda: dsa_layer_case(
            mesh, "TND", "cp_shard", "opmesh", q_lens=ht_q, k_lens=ht_k_sharded
        ),
        "tnd_head_tail_hyperparallel_shard": lambda: dsa_layer_case(
            mesh, "TND", "cp_shard", "hyperparallel", q_lens=ht_q, k_lens=ht_k_sharded
        ),
        "tnd_head_tail_opmesh_rep": lambda: dsa_layer_case(
            mesh, "TND", "cp_rep", "opmesh", q_lens=ht_q, k_lens=ht_k_rep
        ),
        "tnd_dp": lambda: dsa_layer_case(mesh, "TND", "tnd_dp", **dp_lens),
        "tnd_dp_mode0": lambda: dsa_layer_case(mesh, "TND", "tnd_dp", mode=0, **dp_lens),
        "errors": lambda: case_errors(mesh),
        "one_gather_per_layer": lambda: case_one_gather_per_layer(mesh),
        # One token over the mesh: ranks whose shards of every key are empty.
        "bsnd_empty_shards_gather_once": lambda: dsa_layer_case(
            mesh, "BSND", "cp_shard", b=2, s1=1, s2=1, cached=True
        ),
        "tnd_empty_shards_gather_once": lambda: dsa_layer_case(
            mesh, "TND", "cp_shard", q_lens=[1, 1], k_lens=[1, 2], cached=True
        ),
        "flash_attn_empty_shards_gather_once": lambda: case_flash_attn_empty_shards(mesh),
        "kl_non_finite": lambda: case_kl_non_finite(mesh),
        # Compressed keys (DeepSeek-V4's indexer): entries of 4 (2 in head-tail) tokens.
        "cmp_bsnd_dp": lambda: dsa_layer_case(mesh, "BSND", "dp", s2=4, cmp=cmp_bsnd),
        "cmp_bsnd_cp_rep": lambda: dsa_layer_case(mesh, "BSND", "cp_rep", s2=4, cmp=cmp_bsnd),
        "cmp_bsnd_cp_shard": lambda: dsa_layer_case(
            mesh, "BSND", "cp_shard", s2=4, cmp=cmp_bsnd, cached=True
        ),
        "cmp_bsnd_cp_shard_mode0": lambda: dsa_layer_case(
            mesh, "BSND", "cp_shard", mode=0, s2=4, cmp=cmp_bsnd
        ),
        "cmp_tnd_cp_shard": lambda: dsa_layer_case(mesh, "TND", "cp_shard", cmp=cmp_tnd, **tnd_cmp),
        "cmp_tnd_cp_rep": lambda: dsa_layer_case(mesh, "TND", "cp_rep", cmp=cmp_tnd, **tnd_cmp),
        "cmp_bsnd_head_tail_opmesh": lambda: dsa_layer_case(
            mesh, "BSND", "cp_shard", "opmesh", s1=4 * cp, s2=2 * cp, cmp=dict(cmp_ratio=2)
        ),
        "cmp_tnd_head_tail_hyperparallel": lambda: dsa_layer_case(
            mesh,
            "TND",
            "cp_shard",
            "hyperparallel",
            q_lens=ht_q,
            k_lens=[2 * cp, 0, 4 * cp],
            cmp=dict(cmp_ratio=2),
        ),  # fmt: skip
        "cmp_tnd_dp": lambda: dsa_layer_case(
            mesh, "TND", "tnd_dp", cmp=dict(cmp_ratio=3), **dp_lens
        ),
    }
    if mesh.ndim == 2:
        dp = mesh.size(0)
        first_axis_lens = dict(
            q_lens=_whole_sequence_lengths(3 * dp + 1, dp, 0.3, empty=True),
            k_lens=_whole_sequence_lengths(5 * dp + 2, dp, 0.6, empty=True),
        )
        # HyperParallel's TND data parallel: the keys' T2 sharded over the dp axis, every shard
        # boundary on a sequence boundary (the dense indexer and KL loss included).
        cases["tnd_dp_first_axis"] = lambda: dsa_layer_case(
            mesh, "TND", "tnd_dp_first_axis", **first_axis_lens
        )
        cases["tnd_dp_first_axis_mode0"] = lambda: dsa_layer_case(
            mesh, "TND", "tnd_dp_first_axis", mode=0, **first_axis_lens
        )
        cases["bsnd_two_axes"] = lambda: dsa_layer_case(mesh, "BSND", "cp_two_axes", b=2)
        cases["tnd_two_axes"] = lambda: dsa_layer_case(mesh, "TND", "cp_two_axes", **varlen)
    return cases


CASE_NAMES = [
    "bsnd_dp",
    "bsnd_cp_rep",
    "bsnd_cp_shard",
    "bsnd_cp_shard_lengths",
    "bsnd_cp_shard_mode0",
    "bsnd_cp_shard_softcap",
    "tnd_cp_rep_softcap",
    "bsnd_head_tail_opmesh_shard",
    "bsnd_head_tail_hyperparallel_shard",
    "bsnd_head_tail_hyperparallel_rep",
    "tnd_cp_rep",
    "tnd_cp_shard",
    "tnd_head_tail_opmesh_shard",
    "tnd_head_tail_hyperparallel_shard",
    "tnd_head_tail_opmesh_rep",
    "tnd_dp",
    "tnd_dp_mode0",
    "errors",
    "one_gather_per_layer",
    "bsnd_empty_shards_gather_once",
    "tnd_empty_shards_gather_once",
    "flash_attn_empty_shards_gather_once",
    "kl_non_finite",
    "cmp_bsnd_dp",
    "cmp_bsnd_cp_rep",
    "cmp_bsnd_cp_shard",
    "cmp_bsnd_cp_shard_mode0",
    "cmp_tnd_cp_shard",
    "cmp_tnd_cp_rep",
    "cmp_bsnd_head_tail_opmesh",
    "cmp_tnd_head_tail_hyperparallel",
    "cmp_tnd_dp",
]
TWO_AXIS_CASES = [
    "bsnd_two_axes",
    "tnd_two_axes",
    "tnd_dp_first_axis",
    "tnd_dp_first_axis_mode0",
]


def _layer_step(x, cached, prefetch=False):
    """One training step of a DSA layer on sequence-sharded keys: the indexer's selection,
    sparse attention and the sparse KL loss, forward and backward; returns the gradients."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in x}
    block = opmesh.gather_once() if cached else contextlib.nullcontext()
    with block:
        if prefetch:
            opmesh.prefetch_gather(leaves["key"], 1)
        indices = opmesh.lightning_indexer(
            leaves["query_index"], leaves["key_index"], leaves["weights"], sparse_count=TOP_K
        )[0]
        out, smax, ssum = opmesh.sparse_flash_attention(
            leaves["query"], leaves["key"], leaves["value"], indices, SCALE,
            query_rope=leaves["query_rope"], key_rope=leaves["key_rope"], return_softmax_lse=True,
        )  # fmt: skip
        loss = opmesh.sparse_indexer_kl_loss(
            leaves["query_index"], leaves["key_index"], leaves["weights"],
            leaves["query"].detach(), leaves["key"].detach(), indices, smax, ssum, SCALE,
            query_rope=leaves["query_rope"].detach(), key_rope=leaves["key_rope"].detach(),
        )  # fmt: skip
        total = (out * x["gout"]).sum() + loss.sum()
    total.full_tensor().backward()
    return {n: v.grad for n, v in leaves.items() if v.grad is not None}


def case_one_gather_per_layer(mesh):
    """With gather_once(), one DSA layer step all-gathers each sharded key once forward and
    reduce-scatters its gradient once backward; without, every op gathers its own; the
    gradients are the same."""
    from torch.distributed.tensor.debug import CommDebugMode

    names = (
        "query_index", "key_index", "weights", "query", "key", "value", "query_rope",
        "key_rope", "gout",
    )  # fmt: skip
    x = _inputs("BSND", 2, 13, 13)
    dx = {
        n: opmesh.distribute_tensor(x[n], mesh, _placements(mesh, "BSND", "cp_shard", n))
        for n in names
    }
    counts, grads = {}, {}
    for mode in ("plain", "cached", "prefetch"):
        with CommDebugMode() as comm:
            grads[mode] = _layer_step(dx, mode != "plain", prefetch=mode == "prefetch")
        table = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        counts[mode] = (
            table.get("all_gather_into_tensor", 0),
            table.get("reduce_scatter_tensor", 0),
        )
    # Sharded keys: key_index (indexer, KL), key and key_rope (attention, KL), value.
    assert counts["plain"] == (7, 4), f"without the cache: {counts}"
    assert counts["cached"] == (4, 4), f"with gather_once: {counts['cached']}"
    assert counts["prefetch"] == (4, 4), f"with a prefetch: {counts['prefetch']}"
    for name, grad in grads["plain"].items():
        for mode in ("cached", "prefetch"):
            _compare(f"{mode} {name}.grad", grads[mode][name].full_tensor(), grad.full_tensor())
    _expect(
        ValueError,
        "prefetch_gather: needs an active opmesh.gather_once() block",
        lambda: opmesh.prefetch_gather(dx["key"], 1),
    )


def case_flash_attn_empty_shards(mesh):
    """flash_attn on one token whose query, key and value are sharded over the mesh's last axis
    (most ranks hold empty shards of all three), inside a gather_once() block: output and
    gradients equal one device, and every rank gathers the key and the value."""
    from torch.distributed.tensor.debug import CommDebugMode

    g = torch.Generator().manual_seed(5)
    x = {n: torch.randn(2, 1, h, D, generator=g) for n, h in (("q", N1), ("k", N2), ("v", N2))}
    up = torch.randn(2, 1, N1, D, generator=g)
    leaves = {n: v.clone().requires_grad_() for n, v in x.items()}
    want = opmesh.flash_attn(*leaves.values(), mask_mode=3)[0]
    (want * up).sum().backward()
    seq = [R] * (mesh.ndim - 1) + [Shard(1)]
    dx = {n: opmesh.distribute_tensor(v, mesh, seq).detach().requires_grad_() for n, v in x.items()}
    with CommDebugMode() as comm, opmesh.gather_once():
        got = opmesh.flash_attn(*dx.values(), mask_mode=3)[0]
    gathers = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    assert gathers.get("all_gather_into_tensor", 0) >= 2, f"collectives: {gathers}"
    (got.full_tensor() * up).sum().backward()
    _compare("flash_attn", got.full_tensor(), want)
    for n in dx:
        _compare(f"flash_attn d{n}", dx[n].grad.full_tensor(), leaves[n].grad)


def _kl_args(t, selection):
    """A KL front's positional arguments (the sparse one's with its selection)."""
    return [t["query_index"], t["key_index"], t["weights"], t["query"], t["key"], *selection,
            t["main_max"], t["main_sum"], SCALE]  # fmt: skip


def case_kl_non_finite(mesh):
    """Both KL losses with a NaN in one rank's query rows, then in a (replicated) key: each rank
    applies the rule to the rows it holds, and the reduced loss is NaN, as on one device; with
    finite inputs it is finite (the same inputs otherwise)."""
    b, s1, s2 = 2, 3 * mesh.size(mesh.ndim - 1) + 1, 11
    x = _inputs("BSND", b, s1, s2)
    indices = opmesh.lightning_indexer(
        x["query_index"], x["key_index"], x["weights"], sparse_count=TOP_K
    )[0]
    for where in (None, ("query_index", (1, s1 - 1, 2, 3)), ("key", (0, 4, 1, 0))):
        y = {n: v.clone() for n, v in x.items()}
        if where is not None:
            y[where[0]][where[1]] = float("nan")
        dy = {
            n: opmesh.distribute_tensor(v, mesh, _placements(mesh, "BSND", "cp_rep", n))
            for n, v in y.items()
        }
        didx = opmesh.distribute_tensor(indices, mesh, _placements(mesh, "BSND", "cp_rep", "query"))
        ropes = dict(query_rope=y["query_rope"], key_rope=y["key_rope"])
        dropes = dict(query_rope=dy["query_rope"], key_rope=dy["key_rope"])
        for sparse in (False, True):
            front = opmesh.sparse_indexer_kl_loss if sparse else opmesh.indexer_kl_loss
            want = front(*_kl_args(y, [indices] if sparse else []), **ropes)
            got = front(*_kl_args(dy, [didx] if sparse else []), **dropes).full_tensor()
            assert got.isnan().all() == want.isnan().all() == (where is not None), (where, got)
            if where is None:
                _compare(f"kl sparse={sparse}", got, want)
