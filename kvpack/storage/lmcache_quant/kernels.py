"""LMCache's TurboQuant Triton kernels, vectorized in PyTorch for CPUs: the same bytes, all programs at once.

LMCache's TurboQuant serde (``lmcache/v1/distributed/serde/turboquant/``) runs three ``@triton.jit`` kernels,
one program per (token, KV head): ``_tq_fused_store_mse`` (binary-search bucketize of the rotated, normalized
key against the Lloyd–Max midpoints, index packing, the key's fp16 norm, the value's min/max quantization),
``_tq_fused_store_fp8`` (fp8 keys, the same values) and ``_tq_full_dequant_kv`` (the inverse). Everything
around them — the normalization and the Hadamard rotation GEMM, the seeds, the centroids, the layout, the
layers kept raw — is LMCache's own Python, which kvpack calls unchanged (:mod:`.codec`).

On a GPU those kernels compile; on a CPU the only way to run them is Triton's interpreter, which executes one
program at a time in NumPy: about 22 ms per (token, KV head) for a store and a load (measured on an AMD EPYC
Zen 4), an hour and more for one 4K-token sample of a 24-layer model. Each class here is launch-compatible
with one kernel (``kernel[grid](*args, **kwargs)``, the same arguments) and computes every program of the
grid at once with tensor ops, writing the same bytes into the same buffer: each step is the kernel's
arithmetic in the kernel's precision (fp32 lanes, ``int32`` truncation, fp16 scales stored as their bit
patterns, little-endian), so the serialized bytes match the interpreted kernels exactly; decoded keys with
norm correction can differ in the last fp16 bit, where a sum over the head dimension is reduced in another
order. ``tests/test_lmcache_quant.py`` checks both against LMCache's kernels under ``TRITON_INTERPRET=1``.

Assumptions the launchers guarantee (checked, a clear error otherwise): keys and values ``[N·H, D]``
contiguous rows, ``D`` a power of two (``BLOCK_D == D``: LMCache's Hadamard needs one anyway), a single
sequence (one row of the block table), 3- or 4-bit codes. The fp8 format is ``e4m3fn`` (Triton's
``float8e4nv``, what LMCache picks on Hopper and newer); the pre-Hopper ``e4b15`` variant is refused. The cast
to fp8 is the GPU's (``cvt.rn.satfinite``: round to nearest even, subnormals kept, saturated at ±448), which is
torch's ``float8_e4m3fn`` cast; Triton's interpreter casts otherwise (ties away from even, no subnormals,
overflow wrapped), so fp8 keys are compared with the interpreter only on values fp8 holds exactly.
"""

from __future__ import annotations

import torch

from ...ops.bitpack import pack_bitstream_fast, unpack_bitstream_fast

BYTE_ORDER_SHIFT = 8  # fp16 bit patterns are stored low byte first


class KernelPort:
    """A launch-compatible stand-in for one ``@triton.jit`` kernel: ``port[grid](*args, **kwargs)``."""

    def __init__(self, launch):
        self._launch = launch
        self.__name__ = launch.__name__

    def __getitem__(self, grid):
        def run(*args, num_warps=None, num_stages=None, **kwargs):  # launch options: meaningless here
            return self._launch(tuple(grid), *args, **kwargs)
        return run


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"TurboQuant kernel port: {what} (the LMCache launcher this port was written for "
                         "guarantees it; a changed LMCache needs the port revisited)")


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` uint8: the fp16 bit pattern of fp32 ``x`` (round to nearest even), low byte first."""
    bits = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> BYTE_ORDER_SHIFT], dim=-1).to(torch.uint8)


def _fp16_from_bytes(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp16 bit patterns given as low / high bytes (any integer dtype)."""
    bits = (lo.to(torch.int32) | (hi.to(torch.int32) << BYTE_ORDER_SHIFT)).to(torch.int16)
    return bits.view(torch.float16).to(torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, D]`` codes in ``[0, 2^bits)`` -> ``[rows, D·bits/8]`` uint8 as the kernels pack them: 4 bits two
    to a byte (the even lane low), 3 bits eight to three bytes (lane ``j`` of a group at bit ``3j`` of a
    little-endian 24-bit word) — each row one little-endian bit stream, kvpack's own
    :func:`~kvpack.ops.bitpack.pack_bitstream_fast` (``D`` a multiple of 8: every row whole bytes)."""
    rows, d = codes.shape
    _check(bits in (3, 4) and d % 8 == 0, f"{bits}-bit codes of a head dim of {d} are not packed by the kernels")
    return pack_bitstream_fast(codes.to(torch.uint8), bits).view(rows, -1)


def unpack_codes(raw: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """``[rows, ≥ d·bits/8]`` uint8 -> ``[rows, d]`` int64 codes: :func:`pack_codes`' inverse (code ``i`` at bit
    ``i·bits`` of its row, as the dequant kernel reads it), by :func:`~kvpack.ops.bitpack.unpack_bitstream_fast`."""
    rows = raw.shape[0]
    stream = raw[:, :d * bits // 8].reshape(-1)
    return unpack_bitstream_fast(stream, bits, rows * d).view(rows, d).long()


def _slot_bases(slots: torch.Tensor, heads: torch.Tensor, block_size: int, strides: tuple[int, int, int]):
    """Byte offsets of (slot, head) pairs in the flattened cache ``[blocks, block_size, heads, slot_bytes]``."""
    stride_block, stride_pos, stride_head = strides
    return (slots // block_size) * stride_block + (slots % block_size) * stride_pos + heads * stride_head


def _scatter(cache: torch.Tensor, bases: torch.Tensor, offset: int, data: torch.Tensor) -> None:
    """``cache[bases[r] + offset + j] = data[r, j]`` (in place: ``cache`` is a view of the serde's buffer)."""
    index = bases[:, None] + offset + torch.arange(data.shape[1])
    cache[index.reshape(-1)] = data.reshape(-1)


def _gather(cache: torch.Tensor, bases: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    return cache[bases[:, None] + offset + torch.arange(count)]


def _quantize_values(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_store_quantized_value``: each ``[D]`` row to ``bits``-bit codes on its own min/max grid.

    Returns ``(codes [rows, D] int32, scale [rows] fp32, minimum [rows] fp32)``: ``scale = (max - min) /
    (2^bits - 1)``, floored at 1e-8; ``code = clamp(int((v - min) / scale + 0.5))`` (the kernel's truncation,
    in fp32)."""
    _check(bits in (3, 4), f"{bits}-bit values (the kernels store 3 or 4)")
    v = values.to(torch.float32)
    low = v.amin(dim=1)
    high = v.amax(dim=1)
    levels = float((1 << bits) - 1)
    scale = (high - low) / levels
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    codes = ((v - low[:, None]) / scale[:, None] + 0.5).to(torch.int32).clamp(0, int(levels))
    return codes, scale, low


def _store_values(cache, bases, values, key_bytes: int, bits: int, data_bytes: int) -> None:
    codes, scale, low = _quantize_values(values, bits)
    packed = pack_codes(codes, bits)
    _check(packed.shape[1] == data_bytes, f"value bytes {packed.shape[1]} != VAL_DATA_BYTES {data_bytes}")
    _scatter(cache, bases, key_bytes, packed)
    _scatter(cache, bases, key_bytes + data_bytes, torch.cat([_fp16_bytes(scale), _fp16_bytes(low)], dim=1))


def _program_bases(n_programs: int, slot_mapping, heads: int, block_size: int, strides):
    pid = torch.arange(n_programs)
    slots = slot_mapping.long()[pid // heads]
    keep = slots >= 0  # a negative slot: the kernel returns without storing
    return pid[keep], _slot_bases(slots[keep], (pid % heads)[keep], block_size, strides)


def _tq_fused_store_mse(grid, Y_ptr, Norms_ptr, Value_ptr, Midpoints_ptr, KV_cache_ptr, Slot_mapping_ptr, *,
                        stride_cache_block, stride_cache_pos, stride_cache_head, D, H, BLOCK_SIZE, BLOCK_D, MSE_BYTES,
                        KPS, VQB, VAL_DATA_BYTES, BLOCK_VAL, MSE_BITS, N_CENTROIDS, BLOCK_GRP=16):
    """Every program of ``_tq_fused_store_mse``: bucketize, pack, the fp16 norm, the values."""
    _check(BLOCK_D == D, f"head dim {D} is not a power of two")
    (n,) = grid
    pid, bases = _program_bases(n, Slot_mapping_ptr, H, BLOCK_SIZE,
                                (stride_cache_block, stride_cache_pos, stride_cache_head))
    y = Y_ptr.reshape(-1, D)[pid]
    # the kernel's binary search over the N_CENTROIDS - 1 sorted midpoints, MSE_BITS steps, lane by lane
    lo = torch.zeros_like(y, dtype=torch.int32)
    hi = torch.full_like(lo, N_CENTROIDS - 1)
    for _ in range(MSE_BITS):
        mid = (lo + hi) >> 1
        above = y >= Midpoints_ptr[mid.clamp(max=N_CENTROIDS - 2).long()]
        lo = torch.where(above, mid + 1, lo)
        hi = torch.where(above, hi, mid)
    codes = lo.clamp(max=N_CENTROIDS - 1)
    packed = pack_codes(codes, MSE_BITS)
    _check(packed.shape[1] == MSE_BYTES, f"key bytes {packed.shape[1]} != MSE_BYTES {MSE_BYTES}")
    _scatter(KV_cache_ptr, bases, 0, packed)
    _scatter(KV_cache_ptr, bases, MSE_BYTES, _fp16_bytes(Norms_ptr.reshape(-1)[pid].to(torch.float32)))
    _store_values(KV_cache_ptr, bases, Value_ptr.reshape(-1, D)[pid], KPS, VQB, VAL_DATA_BYTES)


def _tq_fused_store_fp8(grid, Key_ptr, Value_ptr, KV_cache_ptr, Slot_mapping_ptr, *, stride_cache_block,
                        stride_cache_pos, stride_cache_head, D, H, BLOCK_SIZE, BLOCK_D, KPS, VQB, VAL_DATA_BYTES,
                        BLOCK_VAL, BLOCK_GRP=16, FP8_E4B15=0):
    """Every program of ``_tq_fused_store_fp8``: fp8 (e4m3fn) keys, the values."""
    _check(BLOCK_D == D, f"head dim {D} is not a power of two")
    _check(not FP8_E4B15, "the pre-Hopper fp8 format e4b15 is not ported")
    (n,) = grid
    pid, bases = _program_bases(n, Slot_mapping_ptr, H, BLOCK_SIZE,
                                (stride_cache_block, stride_cache_pos, stride_cache_head))
    keys = Key_ptr.reshape(-1, D)[pid].to(torch.float32).to(torch.float8_e4m3fn)
    _scatter(KV_cache_ptr, bases, 0, keys.view(torch.uint8))
    _store_values(KV_cache_ptr, bases, Value_ptr.reshape(-1, D)[pid], KPS, VQB, VAL_DATA_BYTES)


def _tq_full_dequant_kv(grid, KV_cache_ptr, Block_table_ptr, Centroids_ptr, K_out_ptr, V_out_ptr, stride_ko_b,
                        stride_ko_h, stride_ko_s, stride_vo_b, stride_vo_h, stride_vo_s, stride_cache_block,
                        stride_cache_pos, stride_cache_head, stride_bt_b, *, HEAD_DIM, BLOCK_SIZE, NUM_KV_HEADS,
                        MSE_BYTES, KPS, VQB, VAL_DATA_BYTES, MSE_BITS, KEY_FP8, BLOCK_D, NORM_CORRECTION=0,
                        FP8_E4B15=0):
    """Every program of ``_tq_full_dequant_kv``: keys (centroids × norm, or fp8) and values back to fp16 in
    ``K_out`` / ``V_out`` ``[1, heads, positions, D]``."""
    d = HEAD_DIM
    positions, batch_heads = grid
    _check(BLOCK_D == d, f"head dim {d} is not a power of two")
    _check(batch_heads == NUM_KV_HEADS and Block_table_ptr.shape[0] == 1, "one sequence per launch")
    _check(not FP8_E4B15, "the pre-Hopper fp8 format e4b15 is not ported")
    for out in (K_out_ptr, V_out_ptr):
        _check(out.dim() == 4 and out.shape[0] == 1 and out.shape[1] == NUM_KV_HEADS and out.shape[2] >= positions
               and out.shape[3] == d, f"output of shape {tuple(out.shape)}")
    cache = KV_cache_ptr.reshape(-1)
    pos = torch.arange(positions).repeat_interleave(NUM_KV_HEADS)
    head = torch.arange(NUM_KV_HEADS).repeat(positions)
    blocks = Block_table_ptr[0].long()[pos // BLOCK_SIZE]
    bases = blocks * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_pos + head * stride_cache_head

    if KEY_FP8:
        keys = _gather(cache, bases, 0, d).view(torch.float8_e4m3fn).to(torch.float32)
    else:
        codes = unpack_codes(_gather(cache, bases, 0, MSE_BYTES), MSE_BITS, d)
        keys = Centroids_ptr.to(torch.float32)[codes]
        if NORM_CORRECTION:  # the centroid vector back to unit norm
            keys = keys * (1.0 / torch.sqrt((keys * keys).sum(dim=1, keepdim=True) + 1e-16))
        norm = _gather(cache, bases, MSE_BYTES, 2)
        keys = _fp16_from_bytes(norm[:, 0], norm[:, 1])[:, None] * keys

    if VQB in (3, 4):
        codes = unpack_codes(_gather(cache, bases, KPS, VAL_DATA_BYTES), VQB, d).to(torch.float32)
        sz = _gather(cache, bases, KPS + VAL_DATA_BYTES, 4)
        values = codes * _fp16_from_bytes(sz[:, 0], sz[:, 1])[:, None] + _fp16_from_bytes(sz[:, 2], sz[:, 3])[:, None]
    else:
        values = torch.zeros(len(pos), d)

    shape = (positions, NUM_KV_HEADS, d)
    K_out_ptr[0, :, :positions] = keys.to(torch.float16).view(shape).transpose(0, 1).to(K_out_ptr.dtype)
    V_out_ptr[0, :, :positions] = values.to(torch.float16).view(shape).transpose(0, 1).to(V_out_ptr.dtype)


STORE_MSE = KernelPort(_tq_fused_store_mse)
STORE_FP8 = KernelPort(_tq_fused_store_fp8)
FULL_DEQUANT = KernelPort(_tq_full_dequant_kv)
