"""opmesh: attention operators for PyTorch that work eagerly, under torch.compile and on meshes.

Importing the package loads the compiled extension, which registers the operators under
``torch.ops.opmesh``; the functions below are the documented entry points.
"""

import torch  # noqa: F401  (the extension links against torch's libraries: load them first)
from torch.distributed.tensor import (
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

from . import (
    _C,  # noqa: F401  (registers torch.ops.opmesh.*)
    _fake,  # noqa: F401  (fake implementations registered from Python)
)
from .distributed import (
    DFunction,
    DistributedOp,
    Layout,
    from_head_tail,
    head_tail_cp,
    to_head_tail,
)
from .ops import (
    dense_lightning_indexer_softmax_lse,
    describe_metadata,
    flash_attn,
    flash_attn_metadata,
    kv_cache_write_,
)

__all__ = [
    "DFunction",
    "DistributedOp",
    "Layout",
    "Partial",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "from_head_tail",
    "head_tail_cp",
    "init_device_mesh",
    "to_head_tail",
    "dense_lightning_indexer_softmax_lse",
    "flash_attn",
    "flash_attn_metadata",
    "describe_metadata",
    "kv_cache_write_",
    "simd_levels",
    "active_simd_level",
]


def simd_levels() -> list[str]:
    """SIMD levels the CPU kernels can use on this machine, lowest first."""
    return _C.supported_simd_levels()


def active_simd_level() -> str:
    """The SIMD level the CPU kernels use now; the environment variable OPMESH_SIMD_MAX
    (scalar, avx2, avx512, avx512_bf16) caps it."""
    return _C.active_simd_level()
