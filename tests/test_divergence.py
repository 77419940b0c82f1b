"""kl_per_position against torch's own KL, its clamp at zero, and its refusals."""

import pytest
import torch
import torch.nn.functional as F

from kvpack.divergence import kl_per_position


def test_matches_torch_kl_div_per_position():
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(7, 50, generator=g), -1)
    logp = torch.log_softmax(torch.randn(7, 50, generator=g), -1)
    expected = F.kl_div(logp, ref, log_target=True, reduction="none").sum(-1)  # KL(ref || approx) per row
    got = kl_per_position(ref, logp)
    assert got.shape == (7,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected)
    assert (got > 0).all()


def test_rounding_below_zero_is_clamped_and_real_divergence_kept():
    ref = torch.log_softmax(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)), -1)
    # log-probabilities a few ulps above the reference's everywhere: the plain sum is -1e-6 at each position
    shifted = ref + 1e-6
    assert ((ref.exp() * (ref - shifted)).sum(-1) < 0).all()
    assert torch.equal(kl_per_position(ref, shifted), torch.zeros(4))
    # a position that really diverges keeps its value
    other = shifted.clone()
    other[2] = torch.log_softmax(torch.zeros(32), -1)
    kl = kl_per_position(ref, other)
    assert kl[2] > 0.1 and torch.equal(kl[[0, 1, 3]], torch.zeros(3))


@pytest.mark.parametrize("a, b, message", [
    (torch.zeros(3, 5), torch.zeros(3, 6), "one shape"),
    (torch.zeros(5), torch.zeros(5), "one shape"),
    (torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long), "floating"),
])
def test_refuses_mismatched_or_integer_inputs(a, b, message):
    with pytest.raises(ValueError, match=message):
        kl_per_position(a, b)
