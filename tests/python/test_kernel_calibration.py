"""The bf16 kernel choice stays the same from process to process: a measured choice is kept in a
calibration file per CPU model, level and kind of work, and later processes take it from there,
also while another process saturates a core; the file is read, rewritten when damaged, skipped
when OPMESH_CACHE_DIR is empty, and `python -m opmesh calibrate` rewrites it."""

import json
import os
import subprocess
import sys

import pytest

import opmesh

PROBE = "import json, opmesh; print(json.dumps(opmesh.bf16_kernels()))"
HAS_PAIRS = "avx512_bf16" in opmesh.simd_levels()
FILE = "bf16_kernels.tsv"


def environment(cache):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPMESH_")}
    env["OPMESH_CACHE_DIR"] = str(cache)
    return env


def probe(env):
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def decisions(choice):
    return tuple(choice[kind]["pairs"] for kind in ("compute", "memory"))


def test_the_choice_is_the_same_in_8_processes_while_a_core_is_saturated(tmp_path):
    env = environment(tmp_path)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        choices = [probe(env) for _ in range(8)]
    finally:
        busy.kill()
        busy.wait()
    assert len({decisions(c) for c in choices}) == 1, [decisions(c) for c in choices]
    if not HAS_PAIRS:  # no choice to make at this level
        assert all(not p for c in choices for p in decisions(c))
        return
    assert {c["source"] for c in choices[0].values()} == {"measured"}
    assert {c[k]["source"] for c in choices[1:] for k in c} == {"calibration"}
    for kind in ("compute", "memory"):  # the first process's times, read back
        assert {c[kind]["pairs_ns"] for c in choices} == {choices[0][kind]["pairs_ns"]}
    lines = (tmp_path / FILE).read_text().splitlines()
    assert len(lines) == 2 and all(line.count("\t") == 5 for line in lines)


@pytest.mark.skipif(not HAS_PAIRS, reason="needs a level with bf16-pair kernels")
def test_the_file_decides_and_a_damaged_line_is_measured_again(tmp_path):
    env = environment(tmp_path)
    first = probe(env)
    path = tmp_path / FILE
    flipped = []
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        fields[3] = "fp32" if fields[3] == "pairs" else "pairs"
        flipped.append("\t".join(fields))
    path.write_text("\n".join(flipped) + "\n")
    read = probe(env)
    assert decisions(read) == tuple(not p for p in decisions(first))
    assert {c["source"] for c in read.values()} == {"calibration"}
    # The environment still wins over the file.
    forced = probe(env | {"OPMESH_BF16_KERNELS": "pairs"})
    assert decisions(forced) == (True, True)
    assert {c["source"] for c in forced.values()} == {"environment"}
    path.write_text(flipped[0].rsplit("\t", 3)[0] + "\tfast\tx\ty\n" + flipped[1] + "\n")
    again = probe(env)
    kinds = [line.split("\t")[2] for line in flipped]
    damaged = kinds[0]
    assert again[damaged]["source"] == "measured"
    rewritten = [line for line in path.read_text().splitlines() if f"\t{damaged}\t" in line]
    assert len(rewritten) == 1 and rewritten[0].split("\t")[3] in ("pairs", "fp32")


def test_an_empty_cache_dir_keeps_no_file(tmp_path):
    env = environment(tmp_path)
    env["OPMESH_CACHE_DIR"] = ""
    choice = probe(env)
    if HAS_PAIRS:
        assert {c["source"] for c in choice.values()} == {"measured"}
    assert not any(tmp_path.iterdir())


def test_calibrate_rewrites_the_file_for_later_processes(tmp_path):
    env = environment(tmp_path / "nested" / "folder")  # made on the way
    command = [sys.executable, "-m", "opmesh", "calibrate", "--rounds", "3"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    out = run.stdout
    assert out.startswith("compute: ") and "kept in: " in out
    later = probe(env)
    if HAS_PAIRS:
        assert str(tmp_path / "nested" / "folder" / FILE) in out
        assert {c["source"] for c in later.values()} == {"calibration"}
    with pytest.raises(ValueError, match="^rounds:"):
        opmesh.calibrate_bf16_kernels(0)
    with pytest.raises(TypeError, match="^rounds:"):
        opmesh.calibrate_bf16_kernels(2.5)
