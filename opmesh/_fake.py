"""Fake (shape-only) implementations registered from Python.

flash_attn_metadata may be called with no tensor argument at all, so a C++ Meta kernel has no
device to follow under FakeTensorMode; its plan is a CPU int32 tensor whose length depends on
num_workers only (the extension computes it, so the format stays defined in one place).

With ``num_workers=None`` the plan is sized for the thread count of the process that runs it,
so a traced graph cannot know its length: the fake gives it a data-dependent (unbacked) size,
and an exported program runs with any thread count.
"""

from __future__ import annotations

import torch

from . import _C, _schema


def _check_lengths(batch_size, arrays):
    """What the CPU kernel checks without reading values: int32, 1-D, entry counts, and a device
    whose memory the host can read."""
    for name, t in arrays.items():
        if t is None:
            continue
        if t.device.type == "meta":
            raise ValueError(
                f"{name}: the plan reads the lengths' values; a meta tensor cannot be planned for"
            )
        if t.dtype != torch.int32:
            raise TypeError(f"{name}: expected int32, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
        count = batch_size + 1 if name.startswith("cu_") else batch_size
        torch._check(
            t.shape[0] == count,
            lambda name=name, t=t, count=count: (
                f"{name}: expected {count} entries, got {t.shape[0]}"
            ),
        )


@torch.library.register_fake("opmesh::flash_attn_metadata")
def _flash_attn_metadata_fake(*args, **kwargs):
    # The operator's arguments by their schema names (opmesh/_schema.py), defaults filled in.
    call = {
        **_schema.defaults("flash_attn_metadata"),
        **dict(zip(_schema.positional("flash_attn_metadata"), args, strict=False)),
        **kwargs,
    }
    _check_lengths(call["batch_size"], {name: call[name] for name in _schema.ATTN_LENGTHS})
    num_workers = call["num_workers"]
    if num_workers is not None:
        return torch.empty(_C._metadata_words(num_workers), dtype=torch.int32, device="cpu")
    smallest = _C._metadata_words(1)
    try:
        words = torch.library.get_ctx().new_dynamic_size(min=smallest)
    except Exception:  # noqa: BLE001  (no shape environment: fake tensors outside a trace)
        words = _C._metadata_words(max(1, torch.get_num_threads()))
    return torch.empty(words, dtype=torch.int32, device="cpu")


@torch.library.register_fake("opmesh::sparse_flash_mla_metadata")
def _sparse_flash_mla_metadata_fake(*args, **kwargs):
    call = {
        **dict(zip(_schema.positional("sparse_flash_mla_metadata"), args, strict=False)),
        **kwargs,
    }
    for name, t in call.items():
        # As the CPU kernel, which reads every length array's values (a meta tensor sends the
        # call here: it would get a plan of uninitialized words).
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(
                f"{name}: the plan reads the lengths' values; a meta tensor cannot be planned for"
            )
    num_workers = kwargs.get("num_workers")
    if num_workers is not None:
        return torch.empty(_C._mla_metadata_words(num_workers), dtype=torch.int32, device="cpu")
    try:
        words = torch.library.get_ctx().new_dynamic_size(min=_C._mla_metadata_words(1))
    except Exception:  # noqa: BLE001  (no shape environment: fake tensors outside a trace)
        words = _C._mla_metadata_words(max(1, torch.get_num_threads()))
    return torch.empty(words, dtype=torch.int32, device="cpu")
