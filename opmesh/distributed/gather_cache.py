"""One all-gather of a sharded key per layer step, shared by the ops that read it.

Under context parallel the DSA operators of a layer (the indexer, sparse attention, the KL
loss) and flash_attn all-gather the keys they take sharded along the sequence. Inside a
``gather_once()`` block a tensor gathered once is reused by every later op of the block that
needs the same gather: one all-gather forward, and, because every op then reads the same
gathered tensor, one reduce-scatter of its summed gradient backward.

``prefetch_gather(x, dim)`` starts the gather of ``x`` (sharded along ``dim``) at once, so
that it runs while the rank computes something else (the indexer before sparse attention):
the collective is asynchronous and waited for where its result is first read.
"""

from __future__ import annotations

import contextlib
import threading

from .. import platform as _platform

_state = threading.local()


@contextlib.contextmanager
def gather_once():
    """Within this block each sharded key is all-gathered once (see the module's text)."""
    previous = getattr(_state, "cache", None)
    _state.cache = {}
    try:
        yield
    finally:
        _state.cache = previous


def _identity(x, placements):
    """What makes two DTensors the same gather: the same local data (a detached view of a key
    is the same key), layout and target placements. The data is told by its storage, not its
    address: every empty tensor has address 0, and on a rank whose key and value shards are
    both empty the address would make the value's gather the key's."""
    local = x._local_tensor
    return (
        local.untyped_storage()._cdata,
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
        local._version,
        tuple(x.placements),
        tuple(placements),
        x.device_mesh,
    )


def gathered(x, mesh, placements):
    """``x`` redistributed to ``placements`` (a gather): the block's copy when one exists (a
    tensor that does not require a gradient gets it detached)."""
    p = _platform.current()
    cache = getattr(_state, "cache", None)
    if cache is None:
        return p.redistribute(x, mesh, placements)
    key = _identity(x, placements)
    hit = cache.get(key)
    if hit is None:
        hit = (x, p.redistribute(x, mesh, placements))  # x held: its memory stays its own
        cache[key] = hit
    out = hit[1]
    if out.requires_grad and not x.requires_grad:
        return out.detach()
    if x.requires_grad and not out.requires_grad:
        # First gathered without a gradient: gather again to carry this one's.
        out = p.redistribute(x, mesh, placements)
        cache[key] = (x, out)
    return out


def prefetch_gather(x, dim: int):
    """Starts the all-gather of DTensor ``x`` along its dim ``dim`` (every mesh axis sharding
    it) inside the current ``gather_once()`` block; the ops of the block that gather ``x`` (or a
    detached view of it) the same way take this copy. Returns None."""
    p = _platform.current()
    if getattr(_state, "cache", None) is None:
        raise ValueError("prefetch_gather: needs an active opmesh.gather_once() block")
    if not p.is_dtensor(x):
        raise ValueError(f"x: expected a DTensor, got {type(x).__name__}")
    ndim = len(p.global_shape(x))
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: {dim} is out of range for a {ndim}-D tensor")
    placements = tuple(
        p.replicate() if p.shard_dim(pl) == dim % ndim else pl for pl in p.placements_of(x)
    )
    gathered(x, p.mesh_of(x), placements)
