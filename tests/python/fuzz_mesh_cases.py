"""Seeded random calls on a device mesh, run by test_fuzz_mesh.py.

* flash_attn: random sizes (uneven over the mesh), BSND or BNSD, GQA, masks and windows, sinks,
  softcap, and per mesh axis a random role (data, head or context parallel with a random
  strategy, or replicated), now and then a random placement per tensor instead; against the
  single-device output, lse and gradients (flash_attn_mesh_cases._check); and TND (varlen,
  empty sequences, lengths that put whole sequences on every shard now and then) with the
  tokens or the heads sharded (flash_attn_mesh_cases._check_tnd).
* A whole DSA layer (both indexers, both KL losses and their gradients, the selection, sparse
  attention forward and backward, the fused operator): random BSND sizes or TND lengths (empty
  sequences too), a random scheme (data parallel, the query sequence sharded with keys
  replicated or sharded, both axes), head-tail order, masks 0 and 3, compressed keys, softcap,
  the whole layer in one gather_once block; against the single-device layer
  (dsa_mesh_cases.dsa_layer_case).
* A DeepSeek-V4 attention layer (sparse_flash_mla, SWA, HCA or CSA): random BSND sizes or TND
  lengths, data parallel or the sequence sharded with keys replicated or sharded, head-tail
  order; against the single-device output, lse and gradients (v4_mesh_cases.layer_case).

Each call must give the single-device results or be refused on every rank alike by an
exception whose message starts with an argument's name: never a wrong answer, a crash or a
hang."""

from __future__ import annotations

import random

import torch
from dsa_mesh_cases import dsa_layer_case
from flash_attn_mesh_cases import _aligned_lengths, _check, _check_tnd
from v4_mesh_cases import layer_case as v4_layer_case

from opmesh import Replicate, Shard

CASES_PER_MESH = 30
TND_CASES_PER_MESH = 16
DSA_CASES_PER_MESH = 12
V4_CASES_PER_MESH = 12
R = Replicate()
# What a refusal may name: the operators' arguments, and the mesh fronts' own.
NAMES = {
    a.name
    for op in (
        "flash_attn",
        "dense_lightning_indexer_softmax_lse",
        "lightning_indexer",
        "sparse_flash_attention",
        "dense_lightning_indexer_grad_kl_loss",
        "sparse_lightning_indexer_grad_kl_loss",
        "sparse_flash_mla",
    )  # fmt: skip
    for a in getattr(torch.ops.opmesh, op).default._schema.arguments
}
NAMES |= {"context_parallel", "metadata", "sinks", "softcap", "order"}
NAMES |= {"x", "cu_seqlens"}  # to_head_tail's, which puts the inputs in head-tail order
OUTCOMES = {"ok": 0, "refused": 0}


def _config(rng, mesh):
    """One random call: _check's keyword arguments. The roles and the strategy are drawn to fit
    each other most of the time (the ring and Ulysses take keys sharded like the queries, the
    ring masks 0 and 3 with as many keys as queries under 3, the hybrids the sequence over both
    axes); one axis in ten takes any placements at all."""
    layout = rng.choice(["BSND", "BNSD"])
    seq_dim, head_dim = (1, 2) if layout == "BSND" else (2, 1)
    nkv = rng.choice([1, 2, 3])
    strategy = rng.choice(["all_gather", "all_gather", "ring", "ulysses"])
    hybrid = mesh.ndim == 2 and rng.random() < 0.25
    if hybrid:
        strategy = ("ulysses", rng.choice(["ring", "all_gather"]))
    ring = "ring" in strategy
    kw = dict(
        b=rng.choice([1, 2, 3, 5]),
        s1=rng.choice([1, 3, 7, 9, 16]),
        nkv=nkv,
        nq=nkv * rng.choice([1, 2, 3]),
        layout=layout,
        mask_mode=rng.choice([0, 3, 3] + ([] if ring else [4])),
        context_parallel=strategy,
    )
    kw["s2"] = kw["s1"] if ring and kw["mask_mode"] == 3 else rng.choice([kw["s1"], 5, 12])
    if kw["mask_mode"] == 4:
        kw.update(win_left=rng.choice([-1, 0, 2]), win_right=rng.choice([-1, 0, 1]))
    if rng.random() < 0.2:
        kw["softcap"] = 3.0
    per_tensor = [[], [], []]  # q, k, v: a placement per mesh axis
    heads_split = False
    for _ in range(mesh.ndim):
        role = "cp" if hybrid else rng.choice(["dp", "tp", "cp", "cp", "rep"])
        if rng.random() < 0.1:  # anything at all
            picks = [rng.choice([R, Shard(0), Shard(1), Shard(2), Shard(3)]) for _ in range(3)]
        elif role == "dp":
            picks = [Shard(0)] * 3
        elif role == "tp":
            heads_split = True
            kv = rng.choice([Shard(head_dim), R])
            picks = [Shard(head_dim), kv, kv]
        elif role == "cp":
            kv = Shard(seq_dim) if strategy != "all_gather" else rng.choice([Shard(seq_dim), R])
            picks = [Shard(seq_dim), kv, kv]
        else:
            picks = [R] * 3
        for placements, p in zip(per_tensor, picks, strict=True):
            placements.append(p)
    if rng.random() < 0.25 and not hybrid:
        kw["sinks"] = [Shard(0) if heads_split and rng.random() < 0.5 else R] * mesh.ndim
    kw["placements"] = per_tensor + ([kw["sinks"]] if "sinks" in kw else [])
    return kw


def _dsa_config(rng, mesh):
    """dsa_layer_case's keyword arguments for one random layer."""
    cp = mesh.size(mesh.ndim - 1)
    schemes = ["dp", "cp_rep", "cp_shard", "cp_shard"] + (["cp_two_axes"] if mesh.ndim == 2 else [])
    kw = dict(layout=rng.choice(["BSND", "TND"]), scheme=rng.choice(schemes))
    kw["mode"] = rng.choice([0, 3, 3])
    if kw["layout"] == "BSND":
        kw.update(b=rng.choice([1, 2, 3]), s1=rng.choice([1, 4, 7, 4 * cp]))
        kw["s2"] = rng.choice([kw["s1"], 5, 9, 6 * cp])
    else:
        if kw["scheme"] == "dp":
            kw["scheme"] = "cp_rep"
        b = rng.choice([1, 2, 3, 4])
        kw["q_lens"] = [rng.choice([0, 1, 3, 9, 2 * cp]) for _ in range(b)]
        kw["k_lens"] = [rng.choice([0, 1, 4, 9, 2 * cp]) for _ in range(b)]
    if rng.random() < 0.25 and kw["scheme"] != "dp":  # sequences in 2 * cp chunks
        kw["order"] = rng.choice(["opmesh", "hyperparallel"])
        cp = mesh.size() if kw["scheme"] == "cp_two_axes" else cp
        if kw["layout"] == "BSND":
            kw.update(s1=2 * cp * rng.choice([1, 2]), s2=2 * cp * rng.choice([1, 2, 3]))
        else:
            kw["q_lens"] = [2 * cp * rng.choice([0, 1, 2]) for _ in kw["q_lens"]]
            kw["k_lens"] = [2 * cp * rng.choice([0, 1, 2]) for _ in kw["k_lens"]]
    if rng.random() < 0.2:
        kw["cmp"] = dict(cmp_ratio=rng.choice([2, 3, 4]))
    if rng.random() < 0.2:
        kw["softcap"] = 0.7
    kw["cached"] = rng.random() < 0.3
    return kw


def _v4_config(rng, mesh):
    """v4_mesh_cases.layer_case's arguments for one random layer."""
    cp = mesh.size(mesh.ndim - 1)
    kw = dict(layout=rng.choice(["BSND", "TND"]), kind=rng.choice(["swa", "hca", "csa"]))
    kw["scheme"] = rng.choice(
        ["cp_rep", "cp_shard", "cp_shard"] + (["dp"] * (kw["layout"] == "BSND"))
    )
    if kw["layout"] == "BSND":
        kw.update(b=rng.choice([1, 2, 3]), s=rng.choice([1, 2, 5, 9, 13]))
    else:
        kw["q_lens"] = [rng.choice([0, 1, 4, 9, 17]) for _ in range(rng.choice([1, 2, 3, 4]))]
    if rng.random() < 0.25 and kw["scheme"] == "cp_shard":  # entries in 2 cp chunks too
        kw["order"] = rng.choice(["opmesh", "hyperparallel"])
        if kw["layout"] == "BSND":
            kw["s"] = 8 * cp * rng.choice([1, 2])
        else:
            kw["q_lens"] = [8 * cp * rng.choice([0, 1, 2]) for _ in kw["q_lens"]]
    return kw


def _tnd_config(rng, mesh):
    """_check_tnd's arguments: random lengths (now and then whole sequences on every shard of
    the first axis), and per axis the tokens (keys replicated or sharded), the heads, or
    nothing sharded."""
    nkv = rng.choice([1, 2])
    kw = dict(nkv=nkv, nq=nkv * rng.choice([1, 2, 3]), mask_mode=rng.choice([0, 3, 3, 4]))
    if kw["mask_mode"] == 4:
        kw.update(win_left=rng.choice([-1, 0, 2]), win_right=rng.choice([0, 0, 1]))
    if rng.random() < 0.3:
        m = mesh.size(0)
        kw["q_lens"], kw["k_lens"] = _aligned_lengths(m, rng.choice([1, 5, 9]) * m + 1, 7 * m - 1)
    else:
        b = rng.choice([1, 2, 3, 5])
        kw["q_lens"] = [rng.choice([0, 1, 3, 8, 13]) for _ in range(b)]
        kw["k_lens"] = [rng.choice([0, 2, 3, 8, 13]) for _ in range(b)]
    per_tensor = [[], [], []]
    heads_split = False
    for _ in range(mesh.ndim):
        role = rng.choice(["tokens", "tokens", "heads", "rep"])
        if role == "tokens":
            kv = rng.choice([Shard(0), R])
            picks = [Shard(0), kv, kv]
        elif role == "heads":
            heads_split = True
            kv = rng.choice([Shard(1), R])
            picks = [Shard(1), kv, kv]
        else:
            picks = [R] * 3
        for placements, p in zip(per_tensor, picks, strict=True):
            placements.append(p)
    kw["placements"] = per_tensor
    if rng.random() < 0.25:
        kw["sinks"] = [Shard(0) if heads_split and rng.random() < 0.5 else R] * mesh.ndim
    if rng.random() < 0.2:
        kw["softcap"] = 3.0
    return kw


KINDS = {
    "tnd": (_tnd_config, _check_tnd, {}),
    "mesh": (_config, _check, {}),
    "dsa": (_dsa_config, dsa_layer_case, {"placements": False}),
    "v4": (_v4_config, v4_layer_case, {}),
}


def _case(mesh, i, kind="mesh"):
    def run():
        rng = random.Random(f"{kind}-{tuple(mesh.shape)}-{i}")
        config, check, fixed = KINDS[kind]
        kw = config(rng, mesh)
        try:
            check(mesh, **fixed, **kw)
        except (ValueError, TypeError, NotImplementedError) as e:
            name = str(e).split(":", 1)[0].split(",")[0].strip()
            if name not in NAMES:
                raise AssertionError(f"{kw}: the refusal names no argument: {e}") from e
            OUTCOMES["refused"] += 1
            return
        except AssertionError as e:
            raise AssertionError(f"{kw}: {e}") from e
        OUTCOMES["ok"] += 1

    return run


def fuzz_cases(mesh):
    cases = {f"flash_attn_{i}": _case(mesh, i) for i in range(CASES_PER_MESH)}
    cases.update({f"flash_attn_tnd_{i}": _case(mesh, i, "tnd") for i in range(TND_CASES_PER_MESH)})
    cases.update({f"dsa_layer_{i}": _case(mesh, i, "dsa") for i in range(DSA_CASES_PER_MESH)})
    cases.update({f"v4_layer_{i}": _case(mesh, i, "v4") for i in range(V4_CASES_PER_MESH)})

    def both_outcomes():  # the generator reaches both, or it tests nothing
        assert OUTCOMES["ok"] > 0 and OUTCOMES["refused"] > 0, OUTCOMES

    cases["both_outcomes"] = both_outcomes
    return cases


CASE_NAMES = [f"flash_attn_{i}" for i in range(CASES_PER_MESH)]
CASE_NAMES += [f"flash_attn_tnd_{i}" for i in range(TND_CASES_PER_MESH)]
CASE_NAMES += [f"dsa_layer_{i}" for i in range(DSA_CASES_PER_MESH)]
CASE_NAMES += [f"v4_layer_{i}" for i in range(V4_CASES_PER_MESH)] + ["both_outcomes"]
