"""GPU kernels (Triton), each checked against the PyTorch reference path.

Kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (how CI checks them).
Importing this package never imports Triton; :func:`triton_available` says whether it can be used.
Codecs choose with their ``attention_backend`` setting: ``auto`` (Triton for CUDA tensors when Triton is
installed, the native CPU kernels for CPU tensors where they are built, PyTorch otherwise), ``triton``
(always; on CPU only under the interpreter), ``native`` (the CPU kernels, ``kvpack.attention.cpu``) or
``torch`` (the reference path).
"""

from __future__ import annotations

import importlib.util
import os

import torch

KERNEL_CHOICES = ("auto", "triton", "native", "torch")


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # looked up once, without importing it


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(choice: str, device: torch.device) -> bool:
    """Whether a codec with ``attention_backend=choice`` runs its Triton kernel for tensors on ``device``.

    Raises:
        ValueError: ``choice == "triton"`` where Triton cannot run (not installed, or CPU tensors
            without ``TRITON_INTERPRET=1``).
    """
    if choice in ("torch", "native"):
        return False
    runnable = triton_installed() and (device.type == "cuda" or interpreter_on())
    if choice == "triton":
        if not triton_installed():
            raise ValueError("attention_backend='triton' needs the triton package (pip install triton)")
        if not runnable:
            raise ValueError("attention_backend='triton' on CPU tensors needs TRITON_INTERPRET=1 "
                             "(the Triton interpreter)")
        return True
    return runnable and device.type == "cuda"
