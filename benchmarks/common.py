"""Shared helpers for the benchmarks: timing, peak-memory measurement, result tables."""

from __future__ import annotations

import json
import mmap
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def time_call(fn, *, min_repeats=3, budget_s=3.0, warm_up=True):
    """Median wall time of fn() in seconds, after one untimed warm-up call (unless warm_up is
    False)."""
    if warm_up:
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    return statistics.median(times)


def interleaved(fns, *, budget_s, rounds=3, min_repeats=3):
    """Median seconds of each of fns (time_call medians), timed in turn for `rounds` rounds of
    budget_s / rounds each, after one warm-up call of each: calls compared with each other share
    the machine's drift."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t in zip(fns, times, strict=True):
            t.append(
                time_call(fn, budget_s=budget_s / rounds, min_repeats=min_repeats, warm_up=False)
            )
    return [statistics.median(t) for t in times]


def _status_kib(field, path="/proc/self/status"):
    """A kB field of one of the process's /proc files (status, smaps_rollup)."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in {path}")


def peak_extra_bytes(fn):
    """Resident memory the call adds at its peak, in bytes: resets the process's high-water mark
    (Linux clear_refs), runs fn once, and subtracts the resident size before the call. Covers
    every allocator (ATen's and the C++ kernels' own scratch)."""
    result = fn()  # warm caches and pools first so they do not count
    del result
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    return max(0, peak - before) * 1024


def transparent_huge_pages():
    """The kernel's transparent huge page mode (always, madvise or never), or None where the
    kernel has none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def in_huge_pages(t):
    """A copy of t in memory advised for transparent huge pages (private anonymous memory,
    MADV_HUGEPAGE, as torch's allocator advises its large blocks under THP_MEM_ALLOC_ENABLE=1),
    and the share of its bytes the kernel backed with 2 MiB pages (counted in the process's
    AnonHugePages while the copy is written). The tensor keeps the mapping alive."""
    nbytes = t.numel() * t.element_size()
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    before = _status_kib("AnonHugePages", "/proc/self/smaps_rollup")
    copy = torch.frombuffer(area, dtype=t.dtype).view(t.shape)
    copy.copy_(t)
    huge = _status_kib("AnonHugePages", "/proc/self/smaps_rollup") - before
    return copy, min(1.0, huge * 1024 / nbytes)


def machine_info():
    import opmesh

    kernels = opmesh.bf16_kernels()
    sets = opmesh.kernel_sets()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "opmesh_simd": opmesh.active_simd_level(),
        "bf16_kernels": {kind: f"{c['kernel_set']} ({c['source']})" for kind, c in kernels.items()},
        "kernel_sets": [s["name"] for s in sets["sets"]],
        "amx_tiles": sets["amx_tiles"],
        "isa_caps": {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)},
        "huge_pages": {
            "kernel_mode": transparent_huge_pages() or "absent",
            "opmesh": f"OPMESH_HUGE_PAGES={os.environ.get('OPMESH_HUGE_PAGES') or 'on'}",
            "torch": f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}",
        },
    }


# Environment variables that hold a run below the machine's instruction sets: opmesh's kernel
# level, ATen's vector kernels, oneDNN's and MKL's (torch.mm, SDPA). Results of a run with any of
# them set name them in their header (README: Performance, the AVX2 tier).
ISA_CAPS = (
    "OPMESH_SIMD_MAX",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


def _own_inductor_cache():
    """Points a run held below the machine's instruction sets at an inductor cache of its own,
    unless TORCHINDUCTOR_CACHE_DIR is set. torch 2.13's cache key leaves ATEN_CPU_CAPABILITY out:
    on a Zen 4, a graph compiled by a run held to AVX2 and loaded from the shared cache by a later
    run that was not held corrupted the heap ("corrupted size vs. prev_size"); the other way round,
    a held run would load graphs compiled for the whole machine."""
    caps = [f"{name}-{os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    if caps and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        tag = re.sub(r"[^a-z0-9_.-]", "_", "-".join(caps).lower())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"opmesh-inductor-{tag}"
        )


_own_inductor_cache()


def held_to_avx2():
    """Whether this run is held to the AVX2 tier (ATEN_CPU_CAPABILITY=avx2 or lower)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default")


# opmesh's SIMD levels without bf16 products: their bf16 inputs run on float32 FMA.
FLOAT32_LEVELS = ("scalar", "avx2", "avx512")


def tier_matmul_dtype(dtype):
    """The dtype of the tier's matmul rate, which "% of mm" compares with: float32 on a level with
    no bf16 products (AVX2, AVX-512 without BF16: bf16 inputs run on float32 products there),
    else the inputs' dtype."""
    import opmesh

    return torch.float32 if opmesh.active_simd_level() in FLOAT32_LEVELS else dtype


def as_on_this_tier(fn):
    """fn as torch runs it on a machine of this run's tier. Held to AVX2, torch sends no bf16
    GEMM to oneDNN: it does so only on CPUs with AVX-512BW/VL/DQ or AVX-NE-CONVERT (ATen's
    mkldnn_bf16_device_check, which reads the hardware, not ATEN_CPU_CAPABILITY), so an
    AVX2-only machine runs ATen's own bf16 GEMM. Turning oneDNN off takes the same branch."""
    if not held_to_avx2():
        return fn

    def run(*args, **kwargs):
        # (Not torch.backends.mkldnn.flags, which also sets oneDNN's TF32 switch and warns.)
        before = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            return fn(*args, **kwargs)
        finally:
            torch.backends.mkldnn.enabled = before

    return run


# The label of a bf16 SDPA baseline left on oneDNN's AVX-512 BF16 kernels in a run held to AVX2:
# shown for comparison, not counted as the tier's SDPA.
NOT_ON_THIS_TIER = " [oneDNN AVX-512 BF16, not on an AVX2 machine]"


def tier_compositions(label, fn, *args):
    """A PyTorch composition fn(*args) as a user of this run's tier would run it, as
    {label: callable}: the call as torch runs it on the tier (as_on_this_tier), and where args
    hold bf16 tensors two more. On a tier without bf16 products (tier_matmul_dtype), the same call
    on the bf16 tensors made float32 inside the timed call ("label, float32"): there MKL's float32
    GEMM can beat torch's bf16 one, and opmesh is compared with the strongest alternative. Held
    to AVX2, the bf16 call on oneDNN's AVX-512 BF16 kernels, marked NOT_ON_THIS_TIER: shown for
    comparison, left out of the best."""

    def upcast():
        return fn(
            *(
                a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a
                for a in args
            )
        )

    methods = {label: as_on_this_tier(partial(fn, *args))}
    if not any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
        return methods
    if tier_matmul_dtype(torch.bfloat16) == torch.float32:
        methods[label + ", float32"] = as_on_this_tier(upcast)
    if held_to_avx2():
        methods[label + NOT_ON_THIS_TIER] = partial(fn, *args)
    return methods


def best_on_this_tier(times, ours):
    """The fastest method of times (name -> seconds) other than the names in ours and those
    marked NOT_ON_THIS_TIER."""
    return min(
        (m for m in times if m not in ours and NOT_ON_THIS_TIER not in m), key=lambda m: times[m]
    )


RELEVANT_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)


def _cpu_flags():
    """The CPU flags that decide which kernels can run and which are fast."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in RELEVANT_FLAGS if flag in present]
    except OSError:
        pass
    return []


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def write_results(name, rows, columns, notes=(), tier_baselines=False):
    """Writes rows (list of dicts) as markdown and JSON under benchmarks/results/. With the
    environment variable OPMESH_RESULTS_SUFFIX set, the files are NAME_SUFFIX.* so that results
    from another machine sit beside the others instead of replacing them. tier_baselines: the
    PyTorch baselines ran through as_on_this_tier (the header says so)."""
    suffix = os.environ.get("OPMESH_RESULTS_SUFFIX")
    if suffix:
        name = f"{name}_{suffix}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    lines = [
        f"# {name}",
        "",
        f"Machine: {info['cpu_model']}, {info['threads']} threads, "
        f"torch {info['torch']}, opmesh SIMD {info['opmesh_simd']}",
        "",
        f"CPU flags: {' '.join(info['cpu_flags'])}; AMX tiles: {info['amx_tiles']}; kernel "
        f"sets: {', '.join(info['kernel_sets'])}; bf16 inputs run on: compute "
        f"{info['bf16_kernels']['compute']}, memory {info['bf16_kernels']['memory']}",
        "",
    ]
    lines += [
        f"Memory: transparent huge pages {info['huge_pages']['kernel_mode']}; opmesh advises "
        f"its CPU outputs of 32 MiB and more for them ({info['huge_pages']['opmesh']}); torch's "
        f"allocator advises its large blocks only under THP_MEM_ALLOC_ENABLE=1 "
        f"({info['huge_pages']['torch']})",
        "",
    ]
    if info["isa_caps"]:
        caps = ", ".join(f"{k}={v}" for k, v in info["isa_caps"].items())
        lines += [f"Instruction sets capped for this run: {caps}", ""]
    if tier_baselines and held_to_avx2():
        lines += [
            "Held to AVX2, the PyTorch baselines run as on an AVX2-only machine: torch sends "
            "bf16 GEMMs to oneDNN only on CPUs with AVX-512BW or AVX-NE-CONVERT, so here they "
            f"run ATen's own bf16 GEMM (oneDNN off). Rows marked{NOT_ON_THIS_TIER} keep "
            "oneDNN's AVX-512 BF16 kernels, for comparison; ratios leave them out.",
            "",
        ]
    if tier_baselines and info["opmesh_simd"] == "avx512" and "avx512_bf16" in info["cpu_flags"]:
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
        lines += [
            "Held to AVX-512 without BF16: opmesh's bf16 inputs run on float32 products, and "
            + (
                "oneDNN is held to AVX512_CORE, so torch's bf16 GEMMs convert bf16 in software, "
                "as on a CPU of this tier."
                if isa.upper() == "AVX512_CORE"
                else "oneDNN is not held (set ONEDNN_MAX_CPU_ISA=AVX512_CORE): its bf16 "
                "baselines use AVX-512 BF16 instructions a CPU of this tier lacks."
            ),
            "",
        ]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    lines += ["", *notes]
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    return text


def env_flag(name):
    return os.environ.get(name, "") not in ("", "0")


def timed_between_barriers(fn, repeats, sync=None):
    """Median seconds of fn() after one warm-up call, each call between two barriers."""
    fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def leave_rank():
    """Ends a spawned mesh rank after its process group is destroyed, skipping the interpreter's
    finalisation: DTensor's caches hold the mesh, and with it gloo's worker threads, until then,
    and a worker still letting go of a collective's tensors there aborts the process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
