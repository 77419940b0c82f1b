"""The Triton path of ``kvpack::pca_quant_attention`` as a store calls it (PyTorch only; importing this never
imports Triton: the kernel module is imported when the path first runs, which also registers the op's
CUDA kernel)."""

from __future__ import annotations

import torch

from ..pca_blocks import PCABlocks, pca_blocks_partial, pca_quant_attention
from ..softmax_merge import PartialAttention


def pca_quant_triton_partial(blocks: PCABlocks, qg: torch.Tensor, scaling: float) -> PartialAttention:
    """State of ``qg [H, M, d]`` over the coded blocks by the Triton kernel: on CUDA tensors through the
    op, on CPU tensors (the interpreter) the launcher itself (the op's CPU kernel is the native one)."""
    from .pca_quant_decode import triton_pca_quant_attention

    run = triton_pca_quant_attention if qg.device.type == "cpu" else pca_quant_attention
    return pca_blocks_partial(blocks, qg, scaling, run)
