"""opmesh: attention operators for PyTorch that work eagerly, under torch.compile and on meshes.

Importing the package loads the compiled extension, which registers the operators under
``torch.ops.opmesh``; the functions below are the documented entry points.
"""

__version__ = "0.2.0"

import os

import torch  # (the extension links against torch's libraries: load them first)


def _check_torch_release() -> None:
    """The compiled extension works only with the torch release it was built against."""
    try:
        from ._build_config import TORCH_VERSION
    except ImportError:  # a source tree that was never built: importing _C says so below
        return
    built = TORCH_VERSION.split("+")[0].split(".")[:2]
    found = torch.__version__.split("+")[0].split(".")[:2]
    if built != found:
        raise ImportError(
            f"opmesh {__version__} was built against torch {TORCH_VERSION}, but this environment "
            f"has torch {torch.__version__}: install torch=={'.'.join(built)}.* or rebuild "
            "opmesh against this torch (pip install --no-build-isolation .)"
        )


_check_torch_release()

from torch.distributed.tensor import (  # noqa: E402
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

from . import (  # noqa: E402
    _C,  # noqa: F401  (registers torch.ops.opmesh.*)
    _fake,  # noqa: F401  (fake implementations registered from Python)
)
from .distributed import (  # noqa: E402
    DFunction,
    DistributedOp,
    Layout,
    from_head_tail,
    gather_once,
    head_tail_cp,
    prefetch_gather,
    set_head_tail_cp,
    to_head_tail,
)
from .distributed import sharding as _sharding  # noqa: E402, F401  (DTensor strategies)

#: The prefix for CMake's find_package(opmesh) (C++ programs on libopmesh_ops, no Python needed):
#: the installed package directory holding lib/, include/ and share/cmake/opmesh/.
cmake_prefix_path = os.path.dirname(os.path.abspath(_C.__file__))
from .ops import (  # noqa: E402
    compressor,
    dense_lightning_indexer_grad_kl_loss,
    dense_lightning_indexer_softmax_lse,
    describe_metadata,
    flash_attn,
    flash_attn_metadata,
    indexer_kl_loss,
    kv_cache_write_,
    lightning_indexer,
    merge_attn_states,
    sparse_flash_attention,
    sparse_flash_mla,
    sparse_flash_mla_metadata,
    sparse_indexer_kl_loss,
    sparse_lightning_indexer_grad_kl_loss,
)
from .plan import FlashAttnPlan  # noqa: E402

__all__ = [
    "__version__",
    "DFunction",
    "DistributedOp",
    "FlashAttnPlan",
    "Layout",
    "Partial",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "from_head_tail",
    "gather_once",
    "head_tail_cp",
    "prefetch_gather",
    "set_head_tail_cp",
    "init_device_mesh",
    "to_head_tail",
    "dense_lightning_indexer_softmax_lse",
    "dense_lightning_indexer_grad_kl_loss",
    "indexer_kl_loss",
    "lightning_indexer",
    "sparse_flash_attention",
    "sparse_flash_mla",
    "sparse_flash_mla_metadata",
    "compressor",
    "sparse_lightning_indexer_grad_kl_loss",
    "sparse_indexer_kl_loss",
    "flash_attn",
    "flash_attn_metadata",
    "describe_metadata",
    "kv_cache_write_",
    "merge_attn_states",
    "simd_levels",
    "active_simd_level",
    "bf16_kernels",
    "calibrate_bf16_kernels",
    "kernel_sets",
]


def simd_levels() -> list[str]:
    """SIMD levels the CPU kernels can use on this machine, lowest first."""
    return _C.supported_simd_levels()


def active_simd_level() -> str:
    """The SIMD level the CPU kernels use now; the environment variable OPMESH_SIMD_MAX
    (scalar, avx2, avx512, avx512_bf16, amx_bf16) caps it."""
    return _C.active_simd_level()


def bf16_kernels() -> dict:
    """Which kernels bf16 inputs use at the active level (avx512_bf16 or amx_bf16), per kind of
    work: ``compute`` (prefill, the indexer) and ``memory`` (decode: every sequence has at most
    16 queries).

    Each entry is ``{"pairs": bool, "source": str, "pairs_ns": float, "fp32_ns": float,
    "kernel_set": str}``: the level's bf16-pair kernels (``pairs``: VDPBF16PS, or AMX tiles at
    amx_bf16) or float32 FMA, chosen by a short measurement of both on this CPU (``source``
    "measured", with the best times in ns), or fixed by the environment variable
    ``OPMESH_BF16_KERNELS`` (``auto``, ``pairs``, ``fp32``, or per kind as
    ``compute=fp32,memory=pairs``); ``kernel_set`` names the set that runs. Asking measures if
    nothing has yet.

    A measured choice is kept in a calibration file, one line per CPU model, level and kind
    (``$OPMESH_CACHE_DIR/bf16_kernels.tsv``, else ``$XDG_CACHE_HOME/opmesh/`` or
    ``~/.cache/opmesh/``; ``OPMESH_CACHE_DIR=""`` keeps none), and later processes on a CPU of the
    same model take it from there (``source`` "calibration"): the choice stays the same from
    process to process whatever the machine's load. :func:`calibrate_bf16_kernels` measures
    again, longer, and rewrites it."""
    return {kind: _C._bf16_choice(kind) for kind in ("compute", "memory")}


def calibrate_bf16_kernels(rounds: int = 8) -> dict:
    """Measures the bf16 kernel choice of both kinds of work (see :func:`bf16_kernels`) over
    ``rounds`` interleaved rounds (a process's own first measurement takes 2), best times, and
    writes it to the calibration file that later processes read; the choice this process has
    already taken stays. Returns ``{kind: {"pairs", "source", "pairs_ns", "fp32_ns", "path"}}``
    (``path``: the file, "" when none is kept). ``python -m opmesh calibrate`` runs it; run it on
    a quiet machine."""
    if isinstance(rounds, bool) or not isinstance(rounds, int):
        raise TypeError(f"rounds: expected an int, got {type(rounds).__name__}")
    return {kind: _C._bf16_calibrate(kind, rounds) for kind in ("compute", "memory")}


def kernel_sets() -> dict:
    """The kernel sets usable now and how the amx_bf16 level runs its tiles.

    ``{"sets": [{"name", "isa", "word", "depth_align", "row_align"}, ...], "amx_tiles": str}``,
    lowest level first. ``word`` is ``float32`` or ``bf16_pair``; the alignments are the packed
    operands' geometry the set declares. ``amx_tiles`` is ``hardware`` (the CPU and OS allow AMX),
    ``emulated`` (``OPMESH_AMX_TILES=emulate``: the portable tile emulation, for tests) or
    ``none``."""
    sets, tiles = _C._kernel_sets()
    return {"sets": sets, "amx_tiles": tiles}
