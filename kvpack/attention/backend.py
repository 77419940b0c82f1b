"""Which path a store's attention takes — Triton, the native CPU kernels or PyTorch — decided in one place.

A method's config says what the user allows (``attention_backend``: ``auto`` / ``triton`` / ``native`` /
``torch``); what runs also depends on the tensors' device, on Triton being installed (or its interpreter on)
and on the native kernels being built. :func:`resolve_backend` makes that decision; a store makes it once
(:meth:`kvpack.resident.base.LayerStore.backend`) and its ops take the answer: ``"triton"``, ``"native"`` or
``"torch"``. A store with no kernel of a path runs PyTorch where that path was chosen (the stored parts), while
the shared steps it uses (the chunk merge, dense partial states) still take the path.
"""

from __future__ import annotations

import torch

from .cpu import use_native
from .triton import use_triton

PATHS = ("triton", "native", "torch")


def resolve_backend(choice: str, device: torch.device) -> str:
    """The path for ``attention_backend=choice`` on tensors of ``device``: Triton where it runs there (CUDA, or
    CPU under ``TRITON_INTERPRET=1`` when asked for by name), else the native CPU kernels where they are built,
    else PyTorch.

    Raises:
        ValueError: a path asked for by name (``triton``, ``native``) that cannot run on ``device``.
    """
    if use_triton(choice, device):
        return "triton"
    if use_native(choice, device):
        return "native"
    return "torch"
