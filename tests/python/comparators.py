"""One comparator for every kernel test: infinities and NaNs must sit in the same places, and the
worst finite error is reported with its position."""

from __future__ import annotations

import torch


def assert_close(actual, expected, *, atol, rtol, name="output"):
    actual = actual.double()
    expected = expected.double()
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN at {torch.nonzero(nan_a != nan_e)[:5].tolist()}"
    inf_a, inf_e = torch.isinf(actual), torch.isinf(expected)
    mismatch = (inf_a != inf_e) | (inf_e & (actual != expected))
    assert not mismatch.any(), (
        f"{name}: infinities differ at {torch.nonzero(mismatch)[:5].tolist()}: "
        f"got {actual[mismatch][:5].tolist()}, want {expected[mismatch][:5].tolist()}"
    )
    finite = ~(inf_e | nan_e)
    if not finite.any():
        return
    err = (actual - expected).abs().masked_fill(~finite, 0)
    allowed = atol + rtol * expected.abs().masked_fill(~finite, 0)
    excess = err - allowed
    worst = int(torch.argmax(excess))
    index = list(torch.unravel_index(torch.tensor(worst), actual.shape))
    assert excess.flatten()[worst] <= 0, (
        f"{name}: worst error {err.flatten()[worst].item():.3e} at {[int(i) for i in index]} "
        f"(got {actual.flatten()[worst].item():.8g}, want {expected.flatten()[worst].item():.8g},"
        f" allowed {allowed.flatten()[worst].item():.3e})"
    )
