"""The training examples train: the indexer warm-up (its KL loss falls and the indexer's top-k
recall of the main attention's mass rises, a short run as `make demo` does), DeepSeek sparse
attention's two stages, and context parallel training under torchrun (its loss falls and follows
one process's), and DeepSeek-V4 decoding with paged caches."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(command, timeout):
    """Runs an example; a failure shows its output and errors (not only its exit status)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"exit status {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n"
        f"{result.stderr[-4000:]}"
    )
    return result


def test_train_indexer_warmup_learns():
    result = run(
        [sys.executable, str(ROOT / "examples" / "train_indexer_warmup.py"), "--steps", "40"], 300
    )
    out = result.stdout
    before = float(re.search(r"recall before training: ([0-9.]+)", out).group(1))
    recalls = [float(r) for r in re.findall(r"top-16 recall ([0-9.]+)", out)]
    first, last = map(float, re.search(r"KL per token: ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < 0.7 * first, out
    assert recalls[-1] > before + 0.2, out


def test_train_dsa_two_stages(tmp_path):
    """The DSA example, a short run as `make demo` does: pretraining and the warm-up's KL fall,
    the warm-up raises the indexer's top-k recall, and the model trained through sparse
    attention on the indexer's top-k ends within 0.1 nats of the dense run's task loss."""
    png = tmp_path / "dsa.png"
    result = run(
        [sys.executable, str(ROOT / "examples" / "train_dsa.py"), "--steps", "60", "--plot",
         str(png)],
        300,
    )  # fmt: skip
    out = result.stdout
    first, last = map(float, re.search(r"pretrain: task loss ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < 0.5 * first, out
    kl = re.search(r"warm-up: KL per token ([0-9.]+) -> ([0-9.]+), top-16 recall ([0-9.]+)", out)
    assert float(kl[2]) < 0.3 * float(kl[1]), out
    before = float(re.search(r"recall before the warm-up: ([0-9.]+)", out)[1])
    assert float(kl[3]) > before + 0.3, out
    sparse, dense = map(float, re.search(r"\) ([0-9.]+), dense ([0-9.]+)", out).groups())
    assert sparse < dense + 0.1, out
    assert png.stat().st_size > 10_000


def test_train_dsa_v4_compressed_stages(tmp_path):
    """The DeepSeek-V4 version, as `make demo` runs it: pretraining and the warm-up's KL over
    compressed keys fall, the warm-up raises the indexer's top-4 recall of the attention mass
    over entries by 0.3 and more, and the sparse model ends within 0.3 nats of the dense run."""
    png = tmp_path / "dsa_v4.png"
    result = run(
        [sys.executable, str(ROOT / "examples" / "train_dsa.py"), "--model", "v4", "--steps",
         "120", "--plot", str(png)],
        300,
    )  # fmt: skip
    out = result.stdout
    first, last = map(float, re.search(r"pretrain: task loss ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < 0.85 * first, out
    kl = re.search(r"warm-up: KL per token ([0-9.]+) -> ([0-9.]+), top-4 recall ([0-9.]+)", out)
    assert float(kl[2]) < 0.5 * float(kl[1]), out
    before = float(re.search(r"recall before the warm-up: ([0-9.]+)", out)[1])
    assert float(kl[3]) > before + 0.3, out
    sparse, dense = map(float, re.search(r"entries\) ([0-9.]+), dense ([0-9.]+)", out).groups())
    assert sparse < dense + 0.3, out
    assert png.stat().st_size > 10_000


def test_train_context_parallel_learns_and_matches_one_process():
    """torchrun with 2 ranks: the loss falls, and every step's loss equals that of the same model
    trained in one process on whole sequences."""
    result = run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(ROOT / "examples" / "train_context_parallel.py"), "--check",
        ],
        600,
    )  # fmt: skip
    out = result.stdout
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+) on 2 ranks", out).groups())
    difference = float(re.search(r"largest loss difference from one process: (\S+)", out)[1])
    assert last < 0.1 * first, out
    assert difference < 1e-3, out


def test_train_context_parallel_on_two_nodes():
    """Two nodes of two processes each, joined by torchrun's rendezvous on 127.0.0.1: four ranks
    training with Ulysses context parallel follow one process's losses. The rendezvous store
    lives in this process, as a cluster's would on a host of its own: hosted by one node's agent
    (torchrun's default), it goes away when that node finishes, and the other node's agent, still
    watching its workers, then fails on the lost connection (exit status 1) however well the
    training went."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=600)
    )
    port = store.port
    script = str(ROOT / "examples" / "train_context_parallel.py")
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "opmesh-two-nodes",
                "--rdzv-conf",
                "is_host=false",
                "--node-rank",
                str(node),
                script,
                "--check",
                "--steps",
                "80",
                "--seq",
                "64",
                "--context-parallel",
                "ulysses",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in range(2)
    ]
    outputs = []
    for node in nodes:
        out, err = node.communicate(timeout=600)
        assert node.returncode == 0, f"exit status {node.returncode}\n{out}\n{err[-4000:]}"
        outputs.append(out)
    out = "".join(outputs)
    found = re.search(r"loss ([0-9.]+) -> ([0-9.]+) on 4 ranks \(context parallel, ulysses\)", out)
    assert found, out
    first, last = map(float, found.groups())
    difference = float(re.search(r"largest loss difference from one process: (\S+)", out)[1])
    assert last < 0.5 * first, out
    assert difference < 1e-3, out


def test_decode_v4_with_paged_caches_equals_eager_generation():
    """The DeepSeek-V4 decoding example: raw keys, compressed entries and the indexer's keys in
    paged caches, the compressors' state in state caches; 32 greedy tokens of 3 sequences equal
    transformers' eager generation (the example exits non-zero otherwise)."""
    result = run([sys.executable, str(ROOT / "examples" / "decode_v4.py")], 300)
    assert "equal to transformers' eager generation" in result.stdout, result.stdout
