"""Public functions over the ``torch.ops.opmesh`` operators. They only normalise arguments; the
computation, its validation and its shape function live in the extension."""

from __future__ import annotations

from collections.abc import Sequence

import torch

LengthsLike = torch.Tensor | Sequence[int] | None


def _as_lengths(value: LengthsLike, name: str) -> torch.Tensor | None:
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return torch.tensor(value, dtype=torch.int64)
    raise TypeError(
        f"{name}: expected a 1-D int32/int64 tensor, a list of ints or None, "
        f"got {type(value).__name__}"
    )


def dense_lightning_indexer_softmax_lse(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_qlen: LengthsLike = None,
    actual_seq_klen: LengthsLike = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Softmax statistics of the lightning-indexer score, without materialising the scores.

    For key head ``g``, query row ``i`` and key ``j``::

        I[g, i, j] = sum_{h in group g} weights[i, h]
                     * relu(query_index[i, h, :] . key_index[j, g, :])
        softmax_max[g, i] = max_{j visible} I[g, i, j]
        softmax_sum[g, i] = sum_{j visible} exp(I[g, i, j] - softmax_max[g, i])

    Query head ``h`` belongs to key head ``h // (N1 // N2)``. No scale is applied: fold
    ``1/sqrt(D)`` and ``1/sqrt(N1)`` into ``weights``. A row with no visible key, and a BSND row
    past its sequence's length, gets ``(-inf, 0)``.

    Args:
        query_index: ``[B, S1, N1, D]`` (BSND) or ``[T1, N1, D]`` (TND); float32, bfloat16,
            float16 or float64 (read as float32).
        key_index: ``[B, S2, N2, D]`` or ``[T2, N2, D]``, same dtype; ``N1 % N2 == 0``.
        weights: ``[B, S1, N1]`` or ``[T1, N1]``; the dtype of ``query_index`` or float32.
        actual_seq_qlen: BSND: optional per-sequence query lengths ``[B]`` (each ``<= S1``).
            TND: required cumulative ends ``[B]`` (no leading 0, non-decreasing, last ``== T1``).
        actual_seq_klen: the same for keys.
        layout: ``"BSND"`` or ``"TND"``.
        sparse_mode: 0 = every key visible; 3 = causal aligned to the bottom-right corner of each
            sequence: key ``j`` is visible to query ``i`` iff ``j <= i + s2 - s1``.

    Returns:
        ``(softmax_max, softmax_sum)``, float32, ``[B, N2, S1]`` (BSND) or ``[N2, T1]`` (TND).

    Work is tiled (query tiles x 64-key tiles) with the relu and weighted head sum fused and an
    online max/sum, so extra memory is O(tile) whatever the sequence lengths; fully masked tiles
    are skipped.
    """
    return torch.ops.opmesh.dense_lightning_indexer_softmax_lse(
        query_index,
        key_index,
        weights,
        actual_seq_qlen=_as_lengths(actual_seq_qlen, "actual_seq_qlen"),
        actual_seq_klen=_as_lengths(actual_seq_klen, "actual_seq_klen"),
        layout=layout,
        sparse_mode=sparse_mode,
    )
