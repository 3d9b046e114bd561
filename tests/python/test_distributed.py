"""The indexer and a user-defined DFunction on real process groups: gloo, spawned processes, one
process group per mesh shape shared by all its cases. Meshes (2,) and (4,) named ("cp",), and
(2, 4) named ("dp", "cp"): 8 ranks. Every case compares full_tensor() with the single-device
call on the same inputs (float32, relative error <= 1e-6)."""

import sys

import pytest
import torch
from distributed_cases import CASE_NAMES, KL_CASE_NAMES, TWO_AXIS_CASES
from mesh_runner import SUITES, mesh_results

import opmesh

SUITE = "distributed"


@pytest.fixture(scope="module", params=SUITES[SUITE][3])
def mesh_and_results(request, tmp_path_factory):
    return request.param, mesh_results(SUITE, request, tmp_path_factory)


@pytest.mark.parametrize("case", CASE_NAMES + KL_CASE_NAMES + TWO_AXIS_CASES)
def test_case_on_mesh(mesh_and_results, case):
    mesh, results = mesh_and_results
    if case in TWO_AXIS_CASES and "x" not in mesh:
        pytest.skip("needs a two-axis mesh")
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"


def test_head_tail_balances_causal_work():
    from opmesh.distributed.context_parallel import causal_work_per_rank

    for cp in (2, 4, 8):
        plain = causal_work_per_rank(4096, 4096, cp, head_tail=False)
        zigzag = causal_work_per_rank(4096, 4096, cp, head_tail=True)
        assert sum(plain) == sum(zigzag) == 4096 * 4097 // 2
        assert max(zigzag) / min(zigzag) < 1.0 + 1e-9  # exactly balanced for S1 == S2
        assert max(plain) / min(plain) > 2 * cp - 2


def test_to_head_tail_round_trip():
    x = torch.arange(24).view(2, 12)
    y = opmesh.to_head_tail(x, 1, 3)
    assert y[0].tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert torch.equal(opmesh.from_head_tail(y, 1, 3), x)
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        opmesh.to_head_tail(x, 1, 4)


def test_yaml_registry_user_directory_and_duplicates(tmp_path, monkeypatch):
    from opmesh.distributed import distributed_op as registry

    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    (module_dir / "my_rules.py").write_text(
        "import opmesh\n"
        "class MyRules(opmesh.DistributedOp):\n"
        "    def __init__(self):\n"
        "        super().__init__('my_user_op')\n"
    )
    yaml_dir = tmp_path / "yaml"
    yaml_dir.mkdir()
    (yaml_dir / "mine.yaml").write_text(
        "my_user_op:\n  distributed_op_class: MyRules\n  distributed_op_file: my_rules\n"
    )
    monkeypatch.setenv(registry.YAML_DIR_ENV, str(yaml_dir))
    monkeypatch.setenv(registry.MODULE_PATH_ENV, str(module_dir))
    registry.reset_registry_for_tests()
    try:
        op = registry.get_distributed_op("my_user_op")
        assert type(op).__name__ == "MyRules" and op.op_name == "my_user_op"
        assert registry.get_distributed_op("dense_lightning_indexer_softmax_lse") is not None
        (yaml_dir / "again.yaml").write_text(
            "my_user_op:\n  distributed_op_class: Other\n  distributed_op_file: other\n"
        )
        registry.reset_registry_for_tests()
        with pytest.raises(ValueError, match="declared twice") as info:
            registry.get_distributed_op("anything")
        assert "again.yaml" in str(info.value) and "mine.yaml" in str(info.value)
        with pytest.raises(ValueError, match="already registered"):
            type(op)()
    finally:
        monkeypatch.delenv(registry.YAML_DIR_ENV)
        registry.reset_registry_for_tests()
        sys.path.remove(str(module_dir)) if str(module_dir) in sys.path else None


def test_yaml_defaults_module_key_and_one_class_for_several_ops(tmp_path, monkeypatch):
    """A file's __default__ entry fills in every entry; distributed_op_module names the module;
    a class whose constructor takes the op name is constructed once per op it serves."""
    from opmesh.distributed import distributed_op as registry

    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    (module_dir / "shared_rules.py").write_text(
        "import opmesh\nclass SharedRules(opmesh.DistributedOp):\n    pass\n"
    )
    yaml_dir = tmp_path / "yaml"
    yaml_dir.mkdir()
    (yaml_dir / "shared.yaml").write_text(
        "__default__:\n"
        "  distributed_op_class: SharedRules\n"
        "  distributed_op_module: shared_rules\n"
        "shared_op_a: {}\n"
        "shared_op_b:\n"
        "  dist_op_name: _shared_op_b_dist_op\n"
    )
    monkeypatch.setenv(registry.YAML_DIR_ENV, str(yaml_dir))
    monkeypatch.setenv(registry.MODULE_PATH_ENV, str(module_dir))
    registry.reset_registry_for_tests()
    try:
        a = registry.get_distributed_op("shared_op_a")
        b = registry.get_distributed_op("shared_op_b")
        assert type(a) is type(b) and type(a).__name__ == "SharedRules"
        assert (a.op_name, b.op_name) == ("shared_op_a", "shared_op_b")
        # The packaged KL-loss rules: one class, two ops, declared through __default__.
        loss = registry.get_distributed_op("indexer_kl_loss")
        fused = registry.get_distributed_op("dense_lightning_indexer_grad_kl_loss")
        assert type(loss) is type(fused) and loss is not fused
        (yaml_dir / "broken.yaml").write_text("__default__:\n  distributed_op_class: X\nop_c: {}\n")
        registry.reset_registry_for_tests()
        with pytest.raises(ValueError, match="entry 'op_c' needs 'distributed_op_class' and"):
            registry.get_distributed_op("op_c")
    finally:
        monkeypatch.delenv(registry.YAML_DIR_ENV)
        registry.reset_registry_for_tests()
        sys.path.remove(str(module_dir)) if str(module_dir) in sys.path else None


def test_platform_is_selected_by_environment(monkeypatch):
    from opmesh import platform

    assert platform.current().name == "torch"
    with pytest.raises(ValueError, match="OPMESH_PLATFORM"):
        platform._load("nonsense")


def test_to_head_tail_per_sequence_round_trip_and_errors():
    cu = torch.tensor([0, 8, 8, 24], dtype=torch.int32)  # an empty sequence in the middle
    x = torch.arange(24)
    rank0 = [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]  # chunks 0 and 3 of each sequence
    want = {
        "opmesh": rank0 + [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19],  # chunks 1, 2
        "hyperparallel": rank0 + [4, 5, 2, 3, 16, 17, 18, 19, 12, 13, 14, 15],  # chunks 2, 1
    }
    for order, expected in want.items():
        y = opmesh.to_head_tail(x, 0, 2, order, cu_seqlens=cu)
        assert y.tolist() == expected, order
        assert torch.equal(opmesh.from_head_tail(y, 0, 2, order, cu_seqlens=cu), x)
        wide = torch.stack([x, -x], dim=1)  # another dim alongside
        assert torch.equal(opmesh.to_head_tail(wide, 0, 2, order, cu_seqlens=cu)[:, 1], -y)
    with pytest.raises(ValueError, match="^cu_seqlens: sequence 2 has 10 tokens, not a multiple"):
        opmesh.to_head_tail(torch.arange(18), 0, 2, cu_seqlens=[0, 8, 8, 18])
    with pytest.raises(ValueError, match="^cu_seqlens: expected cumulative lengths from 0 to 24"):
        opmesh.to_head_tail(x, 0, 2, cu_seqlens=[0, 8, 20])
