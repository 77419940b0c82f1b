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

from .. import cpu
from ..chunk_op import native_history_and_chunk
from ..dense import dense_state
from ..softmax_merge import attend_history_and_chunk

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


FUSED_CHUNK_MAX = 16  # queries per chunk that the one-launch chunk attention takes (decode, draft verification)


def history_and_chunk(history: list, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                      q_heads: int, backend: str, tail: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's attention over the stored states, the stored dense ``tail`` (keys, values
    ``[kv_heads, T, d]``, or None) and itself: ``(out [q_heads, Q, d] fp32, m, l)`` (``m, l
    [kv_heads, group · Q]``: the merged state's). One Triton launch
    (``chunk_attend.fused_history_and_chunk``) where ``backend`` runs Triton for these tensors and the
    chunk has at most ``FUSED_CHUNK_MAX`` queries; ``softmax_merge.attend_history_and_chunk``
    otherwise (longer chunks, such as a prompt after a compressed history, keep the PyTorch path's
    one block of logits; the kernel would loop over them in 16-row tiles — not measured against it).
    On CPU tensors the same op's native kernel where ``backend`` picks it (``cpu.use_native``)."""
    if k.shape[1] <= FUSED_CHUNK_MAX and use_triton(backend, qg.device):
        from .chunk_attend import fused_history_and_chunk

        return fused_history_and_chunk(history, qg, k, v, scaling, q_heads, tail)
    if k.shape[1] <= FUSED_CHUNK_MAX and qg.dtype != torch.float64 and cpu.use_native(backend, qg.device):
        return native_history_and_chunk(history, qg, k, v, scaling, q_heads, tail)
    if tail is not None and tail[0].shape[1]:
        history = [*history, dense_state(qg, *tail, scaling, backend)]
    out, merged = attend_history_and_chunk(history, qg, k, v, scaling, q_heads)
    return out, merged.m, merged.l
