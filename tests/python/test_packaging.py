"""What the installed package promises: a version, type information, a clear refusal of another
torch release, and no hidden dependency (numpy, matplotlib) in the operators' paths. The full
check of an isolated build and install in a fresh environment is tests/packaging/check_install.sh
(make test-packaging)."""

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import opmesh


def _python(code):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_version_matches_the_distribution():
    assert opmesh.__version__ == importlib.metadata.version("opmesh")


def test_type_information_ships():
    assert (Path(opmesh.__file__).parent / "py.typed").exists()


def test_another_torch_release_is_refused_at_import():
    done = _python(
        """
        import sys, types
        fake = types.ModuleType("opmesh._build_config")
        fake.TORCH_VERSION = "2.99.0"
        sys.modules["opmesh._build_config"] = fake
        try:
            import opmesh
        except ImportError as e:
            print("REFUSED", e)
        """
    )
    assert "REFUSED opmesh" in done.stdout and "torch 2.99.0" in done.stdout, done.stderr[-2000:]


def test_operators_and_plan_summaries_need_no_numpy():
    done = _python(
        """
        import sys
        sys.modules["numpy"] = None  # any import of numpy now fails
        import torch, opmesh
        plan = opmesh.flash_attn_metadata(4, 2, 16, batch_size=1, max_seqlen_q=8, max_seqlen_kv=8)
        summary = opmesh.describe_metadata(plan)
        q = torch.randn(1, 8, 4, 16)
        k = torch.randn(1, 8, 2, 16)
        opmesh.flash_attn(q, k, k, metadata=plan)
        opmesh.dense_lightning_indexer_softmax_lse(q, k, torch.randn(1, 8, 4))
        print("OK", summary["makespan"] > 0)
        """
    )
    assert "OK True" in done.stdout, done.stderr[-2000:]


def test_plan_drawing_without_matplotlib_says_how_to_get_it():
    done = _python(
        """
        import sys
        sys.modules["matplotlib"] = None
        from opmesh.__main__ import main
        main(["plan", "--seqlens-q", "70", "9", "--png", "/tmp/never-written.png"])
        """
    )
    assert done.returncode != 0
    assert "pip install 'opmesh[plot]'" in done.stderr, done.stderr[-2000:]
