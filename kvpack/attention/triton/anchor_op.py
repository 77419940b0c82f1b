"""The AnchorKV decode kernel as a PyTorch custom op (``kvpack::anchor_segment_attention``), plus its launcher.

:func:`anchor_partials` is what ``AnchorStore`` calls with its :class:`AnchorSegment` views: one
launch per compressed segment (one segment unless re-compression is on), returning each segment's
merged softmax state. One schema, two backends: the Triton kernel (CUDA; CPU tensors under
``TRITON_INTERPRET=1``, the launcher called directly) and the native CPU kernel
(``kvpack/attention/cpu/csrc/anchor.cpp``), bound to the op's CPU dispatch in C++ (``csrc/bindings.cpp``).
"""

from __future__ import annotations

import math

import torch

from ..anchor import PREFIX_BLOCK, SEGMENT_OPERANDS, AnchorSegment
from ..softmax_merge import PartialAttention
from ._launch import ROW_BLOCK, kernel_arg, launch, pow2, row_blocks, split_state_buffers

_BLOCK = PREFIX_BLOCK  # prefix-count block of the residual slots
# Warps per program. Compiled for d = 128 (benchmarks/kernel_resources.py) at Triton's default of 4,
# the 2-bit kernel spilled 16-80 bytes per thread on sm_80 (0-64 on sm_90) where the segment length
# is not a multiple of 16 (most prompts: Triton cannot then assume aligned per-token rows), and the
# 4-bit tier 104 bytes even at aligned lengths. At 8, the 2-bit kernel takes 176-219 registers and
# spills nothing; the 4-bit tier takes 206-221 at aligned lengths, and 255 with 16 (sm_80) / 64
# (sm_90) bytes spilled otherwise (not removed: docs/kernels.md).
KERNEL_WARPS = 8


def _triton_anchor_segment_attention(
    q: torch.Tensor, segment: list[torch.Tensor], levels: list[float], hfactor: float, scaling: float,
    first_position: int, blocks_per_split: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state ``(m [H, M], l [H, M], o [H, M, D])`` fp32 of grouped queries ``q [H, M, D]``
    over one AnchorKV segment (``segment``: its tensors as :data:`~kvpack.attention.anchor.SEGMENT_OPERANDS`
    names them, :meth:`AnchorSegment.operands`) of ``n = index_k.shape[1]`` tokens from position
    ``first_position`` (layouts in ``anchor_decode.anchor_split_kernel``; ``cos``/``sin`` are the shared
    RoPE tables of ``RotaryTable.table``, half-width rows when both halves are equal). The residual codec
    enters as its fp16 ``levels``, its rotation ``hfactor · hmat`` with ``hmat`` fp16 and exactly 0/±1
    (``ResidualCodec.kernel_matrix``), and its ``signs``. The fine (4-bit) tier's eight tensors and its
    16 ``fine_levels`` (fp32) are empty when the segment has none."""
    from .anchor_decode import anchor_split_kernel
    from .split_merge import merge_splits

    if len(segment) != len(SEGMENT_OPERANDS):
        raise ValueError(f"anchor_segment_attention: expected the {len(SEGMENT_OPERANDS)} tensors of "
                         f"SEGMENT_OPERANDS, got {len(segment)}")
    t = dict(zip(SEGMENT_OPERANDS, segment))
    hmat, cos, sin, index_k = t["hmat"], t["cos"], t["sin"], t["index_k"]
    H, M, D = q.shape
    if hmat.dtype != torch.float16 or hmat.shape != (D, D):
        raise ValueError(f"hmat must be the codec's [{D}, {D}] fp16 0/±1 kernel matrix "
                         f"(ResidualCodec.kernel_matrix), got {tuple(hmat.shape)} {hmat.dtype}")
    n = index_k.shape[1]
    n_splits = math.ceil(math.ceil(n / _BLOCK) / blocks_per_split)
    dev = q.device
    m, l, o = split_state_buffers(H, M, D, n_splits, dev)
    W = cos.shape[1]
    fine = t["fine_mask_k"].numel() > 0
    launch(anchor_split_kernel, (H, n_splits, row_blocks(M)),
        q.float().contiguous(), kernel_arg(t["anchor_k"]), kernel_arg(t["anchor_v"]), hmat,
        t["signs"].float().contiguous(), cos, sin, *(kernel_arg(t[name]) for name in SEGMENT_OPERANDS[6:]),
        m, l, o, M, t["anchor_k"].shape[1], D, n, scaling, hfactor, first_position, W, blocks_per_split, n_splits,
        *levels,
        SAME_HALVES=W != D, FINE=fine, BM=ROW_BLOCK, BD=pow2(D), BDH=pow2(D // 2), BT=_BLOCK,
        num_warps=KERNEL_WARPS,
    )
    return merge_splits(m, l, o)  # one more launch (flash-decoding's reduction)


# The op is the Triton launcher itself (its default implementation, for CUDA); the CPU kernel is native.
anchor_segment_attention = torch.library.custom_op("kvpack::anchor_segment_attention", mutates_args=())(
    _triton_anchor_segment_attention)


@anchor_segment_attention.register_fake
def _(q, segment, *args):
    H, M, D = q.shape
    return q.new_empty(H, M, dtype=torch.float32), q.new_empty(H, M, dtype=torch.float32), \
        q.new_empty(H, M, D, dtype=torch.float32)


def anchor_partials(segments: list[AnchorSegment], qg: torch.Tensor, scaling: float,
                    blocks_per_split: int | None = None, native: bool = False) -> list[PartialAttention]:
    """States of ``qg [kv_heads, rows, d]`` over AnchorKV segments (the views an ``AnchorStore`` hands out).

    Args:
        blocks_per_split: 32-token blocks per program (default: about 32 programs per KV head).
        native: run the op's native CPU kernel (CPU tensors); otherwise the Triton kernel (on CPU
            tensors: the launcher itself, under the interpreter).
    """
    if not segments:
        return []
    dev = qg.device
    codec = segments[0].codec  # levels and rotation factor of the layer's residual codec
    hfactor = codec.kernel_matrix[1]
    cos, sin = segments[0].rope.table(max(seg.start + seg.length for seg in segments), dev)
    states = []
    for seg in segments:
        bps = blocks_per_split or max(1, math.ceil(math.ceil(seg.length / _BLOCK) / 32))
        # On CPU tensors without `native`, the Triton launcher itself (the interpreter); else the op.
        run = _triton_anchor_segment_attention if not native and dev.type == "cpu" else anchor_segment_attention
        m, l, o = run(qg.float().contiguous(), seg.operands(cos, sin), [float(x) for x in codec.levels], hfactor,
                      float(scaling), seg.start, bps)
        states.append(PartialAttention(m=m, l=l, o=o))
    return states
