"""KL divergence of a compressed cache's next-token distributions from the exact cache's, per position.

One definition for every fidelity figure kvpack reports: the eval runner's fidelity pass and the per-layer
KL profile both call :func:`kl_per_position`, so their KLs are the same quantity computed the same way.
"""

from __future__ import annotations

import torch


def kl_per_position(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(exact ‖ compressed) at each position, in nats.

    ``ref_logprobs``, ``logprobs``: [positions, vocab] log-probabilities (``log_softmax`` outputs) of the
    exact cache and of the compressed one at the same positions, a floating dtype (fp32 in kvpack's passes).
    Returns [positions], the dtype of the inputs.

    Numerics: KL >= 0 exactly, but where the two distributions agree up to rounding (a cache coded nearly
    losslessly) the fp32 sum can come out a few ulps below zero (seen on an AMD Zen 4); each position is
    clamped at 0, so a mean over positions never is negative.
    """
    if ref_logprobs.shape != logprobs.shape or ref_logprobs.dim() != 2:
        raise ValueError(f"kl_per_position wants two [positions, vocab] log-probability tensors of one shape, "
                         f"got {tuple(ref_logprobs.shape)} and {tuple(logprobs.shape)}")
    if not (ref_logprobs.is_floating_point() and logprobs.is_floating_point()):
        raise ValueError(f"kl_per_position wants floating log-probabilities, got {ref_logprobs.dtype} and "
                         f"{logprobs.dtype}")
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).clamp_min(0.0)
