"""A half-precision model's linear layers with fp32 products, on CPUs with no bf16 / fp16 arithmetic.

On a CPU without AVX-512 BF16 or AMX (every AVX2 CPU, AVX-512 before Cooper Lake / Zen 4) torch's bf16
matmul converts element by element: on a Zen 1 AVX2 EPYC (2 cores), ``[2048, 576] @ [576, 1536]`` ran at
10.1 GFLOP/s in bf16 against 66.9 in fp32, and a 2,048-token prefill of SmolLM2 in bf16 took 47 s, 94% of
it in ``aten::mm`` (``torch.profiler``; SDPA 5%); with :class:`Fp32ProductsLinear`, 11.7 s. It computes
the same product as an fp32 GEMM of the bf16 operands, then rounds to the input's dtype.

Numerics: bf16 (fp16) values are exact in fp32 and so is each product (8 + 8, resp. 11 + 11, significand
bits within fp32's 24); the sum is accumulated in fp32 and the result rounded once to bf16 (fp16) —
the contract of torch's and oneDNN's own half-precision GEMMs (fp32 accumulation, one rounding), with
the summation in another order, as their blockings differ between CPUs too. Tests bound it to one
unit in the last place of the rounded result against the fp64 product.

Only inputs of at least :data:`MIN_ROWS` rows take the fp32 path: the weight is widened on every call
(no fp32 copy is kept, so the model's memory stays what its dtype says), which costs more than it saves
for a decode step's single row. Measured on the same machine (two threads, bf16 kernel vs fp32 products):
SmolLM2's ``[1536, 576]`` layers, 1 row 0.19 vs 0.65 ms, 4 rows 0.72 vs 1.12, 16 rows 2.95 vs 1.66, 64
rows 11.0 vs 2.8 ms; its output layer ``[49152, 576]`` (whose fp32 copy does not fit the cache), 1 row
5.9 vs 50 ms, 16 rows 88 vs 105, 64 rows 353 vs 142 ms. Prefills (their output layer sees one row),
the eval's teacher-forced passes and the question after a restored cache are long inputs; decode steps
keep torch's bf16 kernel.

Attached per model by replacing each ``nn.Linear`` instance with one sharing its parameters (tied
weights stay tied, ``state_dict`` keys are unchanged), and undone the same way: no class of torch or
transformers is patched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.cpu_features import has_bf16_gemm, has_fp16_gemm

HALF_PRODUCTS = ("auto", "native", "float32")
MIN_ROWS = 16  # rows of an input from which the fp32 path is faster (measurements in the module doc)


class Fp32ProductsLinear(nn.Linear):
    """``nn.Linear`` whose bf16 / fp16 CPU inputs of ``>= MIN_ROWS`` rows are multiplied as fp32 and the
    result rounded back to the input's dtype; any other input goes through ``F.linear`` as in
    ``nn.Linear``. Input ``[..., in_features]``, output ``[..., out_features]``."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> Fp32ProductsLinear:
        """The same layer (the same ``weight`` and ``bias`` Parameters, not copies) with fp32 products."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() == 0
                or x.numel() < MIN_ROWS * x.shape[-1]):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def wants_fp32_products(dtype: torch.dtype, device: torch.device | str, mode: str = "auto") -> bool:
    """Whether a model in ``dtype`` on ``device`` gets fp32 products under ``mode`` (one of
    :data:`HALF_PRODUCTS`): ``native`` never, ``float32`` for any bf16 / fp16 model on the CPU, ``auto``
    where the CPU does not multiply that dtype natively (:func:`kvpack.ops.cpu_features.has_bf16_gemm`,
    :func:`~kvpack.ops.cpu_features.has_fp16_gemm`).

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in HALF_PRODUCTS:
        raise ValueError(f"half_products must be one of {HALF_PRODUCTS}, got {mode!r}")
    if mode == "native" or torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if mode == "float32":
        return True
    return not (has_bf16_gemm() if dtype == torch.bfloat16 else has_fp16_gemm())


def _replace_linears(model: nn.Module, make) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = make(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count


def use_fp32_products(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` fp32 products (in place; idempotent). Returns how many
    layers were replaced."""
    return _replace_linears(model, lambda m: Fp32ProductsLinear.sharing(m)
                            if type(m) is nn.Linear else None)


def use_native_products(model: nn.Module) -> int:
    """Undo :func:`use_fp32_products`: plain ``nn.Linear`` layers again, sharing the same parameters.
    Returns how many layers were restored."""
    def plain(m: nn.Module) -> nn.Linear | None:
        if type(m) is not Fp32ProductsLinear:
            return None
        new = nn.Linear(m.in_features, m.out_features, bias=False, device="meta")
        new.weight, new.bias = m.weight, m.bias
        return new
    return _replace_linears(model, plain)
