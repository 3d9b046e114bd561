"""Input builders and the designed case grid for dense_lightning_indexer_softmax_lse."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    batch: int
    s1: int  # BSND: S1; TND: ignored (from lengths)
    s2: int
    n1: int
    n2: int
    d: int
    q_lengths: tuple[int, ...] | None = None  # per-sequence lengths (TND: turned into cum. ends)
    k_lengths: tuple[int, ...] | None = None


# Sizes cover B in {1, 3}; S1 < S2, S1 == S2, S1 > S2 (rows that see nothing); S = 1; awkward
# 17 and 111; N1 in {1, 8, 64}; N2 in {1, 2}; D in {16, 128}; empty sequences in both layouts.
CASES = [
    Case("decode", "BSND", 3, 1, 17, 8, 1, 16),
    Case("square_111", "BSND", 1, 111, 111, 64, 1, 128),
    Case("more_keys", "BSND", 3, 17, 111, 8, 2, 16),
    Case("more_queries", "BSND", 1, 111, 17, 8, 2, 128),
    Case("single_token", "BSND", 1, 1, 1, 1, 1, 16),
    Case("lengths", "BSND", 3, 40, 70, 8, 2, 16, (40, 0, 17), (70, 5, 0)),
    Case("groups_32", "BSND", 1, 70, 130, 64, 2, 16),
    Case("varlen", "TND", 4, 0, 0, 8, 2, 16, (17, 0, 111, 1), (17, 3, 111, 40)),
    Case("varlen_128", "TND", 2, 0, 0, 64, 1, 128, (1, 111), (64, 111)),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# (atol, rtol) per dtype for softmax_max, and rtol for softmax_sum (>= 1, so relative is safe).
# The reference reads the very same (possibly rounded) input values in float64, so low-precision
# inputs add no error of their own: what remains is float32 accumulation over D and the head sum.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5, 5e-5),  # float32 accumulation, different summation order
    torch.bfloat16: (2e-5, 2e-5, 5e-5),  # products exact in float32 (bf16 dot product), same sums
    torch.float16: (2e-5, 2e-5, 5e-5),  # converted exactly to float32, same sums
    torch.float64: (3e-5, 3e-5, 6e-5),  # inputs rounded to float32 (~6e-8 each) before summing
}


def cumulative(lengths):
    return list(itertools.accumulate(lengths))


def make_inputs(case: Case, dtype, *, weights_float32=False, non_contiguous=False, seed=0):
    """Returns (q, k, w, kwargs). Weights carry the usual 1/sqrt(N1 * D) scale."""
    g = torch.Generator().manual_seed(seed)
    if case.layout == "TND":
        t1, t2 = sum(case.q_lengths), sum(case.k_lengths)
        q_shape, k_shape, w_shape = (t1, case.n1, case.d), (t2, case.n2, case.d), (t1, case.n1)
        kwargs = dict(
            actual_seq_qlen=torch.tensor(cumulative(case.q_lengths), dtype=torch.int32),
            actual_seq_klen=torch.tensor(cumulative(case.k_lengths), dtype=torch.int64),
            layout="TND",
        )
    else:
        q_shape = (case.batch, case.s1, case.n1, case.d)
        k_shape = (case.batch, case.s2, case.n2, case.d)
        w_shape = (case.batch, case.s1, case.n1)
        kwargs = dict(layout="BSND")
        if case.q_lengths is not None:
            kwargs["actual_seq_qlen"] = torch.tensor(case.q_lengths, dtype=torch.int64)
        if case.k_lengths is not None:
            kwargs["actual_seq_klen"] = torch.tensor(case.k_lengths, dtype=torch.int32)
    scale = (case.n1 * case.d) ** -0.5
    w_dtype = torch.float32 if weights_float32 else dtype
    if non_contiguous:
        # Last-dim stride 2 for q, a transposed k, a sliced w: only element strides are required.
        q = torch.randn(*q_shape[:-1], 2 * case.d, generator=g).to(dtype)[..., ::2]
        k_t = torch.randn(*k_shape[:-3], k_shape[-2], k_shape[-3], case.d, generator=g)
        k = k_t.to(dtype).transpose(-3, -2)
        w = (torch.randn(*w_shape[:-1], 2 * case.n1, generator=g) * scale).to(w_dtype)[..., 1::2]
        assert not q.is_contiguous()
    else:
        q = torch.randn(q_shape, generator=g).to(dtype)
        k = torch.randn(k_shape, generator=g).to(dtype)
        w = (torch.randn(w_shape, generator=g) * scale).to(w_dtype)
    return q, k, w, kwargs
