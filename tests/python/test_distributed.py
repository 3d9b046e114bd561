"""The indexer and a user-defined DFunction on real process groups: gloo, spawned processes, one
process group per mesh shape shared by all its cases. Meshes (2,) and (4,) named ("cp",), and
(2, 4) named ("dp", "cp"): 8 ranks. Every case compares full_tensor() with the single-device
call on the same inputs (float32, relative error <= 1e-6)."""

import sys

import pytest
import torch
from distributed_cases import CASE_NAMES, TWO_AXIS_CASES
from mesh_runner import run_cases

import opmesh

MESHES = {
    "2": ((2,), ("cp",)),
    "3": ((3,), ("cp",)),
    "4": ((4,), ("cp",)),
    "2x2": ((2, 2), ("dp", "cp")),
    "2x4": ((2, 4), ("dp", "cp")),
}


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_results(request, tmp_path_factory):
    shape, names = MESHES[request.param]
    out = tmp_path_factory.mktemp(f"mesh{request.param}")
    return request.param, run_cases(out, shape, names, "distributed_cases", "cp_cases")


@pytest.mark.parametrize("case", CASE_NAMES + TWO_AXIS_CASES)
def test_case_on_mesh(mesh_results, case):
    mesh, results = mesh_results
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


def test_platform_is_selected_by_environment(monkeypatch):
    from opmesh import platform

    assert platform.current().name == "torch"
    with pytest.raises(ValueError, match="OPMESH_PLATFORM"):
        platform._load("nonsense")
