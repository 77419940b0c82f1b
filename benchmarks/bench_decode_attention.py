"""One decode step of attention over each resident method's layer vs dense SDPA over the same tokens.

Llama-8B head shape (8 KV heads, 32 query heads, d = 128), synthetic keys/values with a decaying
spectrum, batch 1, contexts 8K, 32K and 64K. Reports the median time of one decode attention (the
store's attend(), which merges everything stored and the new token; the native CPU kernels on CPU
tensors where built, ``--torch-path`` adds each row on the PyTorch reference path) against
``torch.nn.functional.scaled_dot_product_attention`` over the dense cache (bf16 and fp32), and the
bytes each holds. StreamingLLM stands for the eviction baselines (H2O and SnapKV keep as many tokens
in the same dense layout and are read by the same kernel; their prefill scoring is O(T²) here).

``--shape smollm2`` times SmolLM2's layer shape instead (3 KV heads, 9 query heads, d = 64): the
kernels' share of the end-to-end decode step that ``bench_decode_e2e.py`` measures.

Usage: python benchmarks/bench_decode_attention.py [--contexts 8192,32768,65536] [--torch-path]
    [--shape llama8b|smollm2] [--methods "puzzle_plus,puzzle_plus fp32,..."]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _util import machine, median_seconds

from kvpack.ops.rope import LlamaRotary, RotaryTable
from kvpack.resident import LayerLayout, get_resident_method

# (label, method, config): every resident method at its default and at 0.25 of the dense bf16 bytes.
ROWS = [
    ("full bf16", "full", {"storage_dtype": "bfloat16"}),
    ("puzzle", "puzzle", {}), ("puzzle int4", "puzzle", {"int4": True}), ("puzzle@0.25", "puzzle", {"budget": 0.25}),
    ("puzzle_plus", "puzzle_plus", {}), ("puzzle_plus@0.25", "puzzle_plus", {"budget": 0.25}),
    # the pre-RoPE rebuild with fp32 products (dot_precision's reference; the rows above use bf16 products
    # where the CPU has AVX-512 BF16)
    ("puzzle_plus fp32", "puzzle_plus", {"dot_precision": "float32"}),
    ("puzzle_plus@0.25 fp32", "puzzle_plus", {"budget": 0.25, "dot_precision": "float32"}),
    ("anchor θ=0.1", "anchor", {"budget": 0.1}), ("anchor@0.25", "anchor", {"budget": 0.25}),
    ("anchor_plus", "anchor_plus", {}), ("anchor_plus@0.25", "anchor_plus", {"budget": 0.25}),
    ("svd@0.25", "svd", {"budget": 0.25}), ("kivi", "kivi", {}), ("kivi@0.25", "kivi", {"budget": 0.25}),
    ("streaming@0.25", "streaming", {"budget": 0.25}),
    ("pca_quant", "pca_quant", {}), ("pca_quant@0.15", "pca_quant", {"budget": 0.15}),
]


# (KV heads, query heads, head_dim, RoPE theta)
SHAPES = {"llama8b": (8, 32, 128, 500000.0), "smollm2": (3, 9, 64, 100000.0)}


def synthetic_kv(H: int, T: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -1.5, d)
    k = (torch.randn(H, T, d, generator=g) * spectrum) @ torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    v = (torch.randn(H, T, d, generator=g) * spectrum) @ torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    return k, v


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="8192,32768,65536")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch-path", action="store_true", help="also every row on the PyTorch path")
    parser.add_argument("--methods", default=",".join(label for label, _, _ in ROWS),
                        help="comma-separated row labels")
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES),
                        help="head shape: llama8b (8 KV heads, 32 query heads, d = 128) or smollm2 (3, 9, 64)")
    args = parser.parse_args()
    H, Hq, d, theta = SHAPES[args.shape]
    scale = d ** -0.5
    print(f"# bench_decode_attention  ({machine()}), {args.shape} head shape: {H} KV heads, {Hq} query heads, d = {d}")
    print("context  method           time ms   vs dense-bf16  vs dense-fp32   bytes MiB  bytes ratio")
    for T in (int(x) for x in args.contexts.split(",")):
        k, v = synthetic_kv(H, T, d)
        q = torch.randn(Hq, 1, d)
        k1, v1 = synthetic_kv(H, 1, d, seed=1)
        dense = {}
        for name, dt in (("dense-bf16", torch.bfloat16), ("dense-fp32", torch.float32)):
            kd = torch.cat([k, k1], 1).to(dt)[None]
            vd = torch.cat([v, v1], 1).to(dt)[None]
            qd = q.to(dt)[None]
            t = median_seconds(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True),
                               args.repeats)
            dense[name] = (t, (kd.numel() + vd.numel()) * kd.element_size())
        ref_bytes = dense["dense-bf16"][1]
        rows = [(name, t, b) for name, (t, b) in dense.items()]
        layout = LayerLayout(layer_idx=0, kv_heads=H, q_heads=Hq, head_dim=d,
                             rope=RotaryTable(LlamaRotary(d, theta=theta), d))
        wanted = set(args.methods.split(","))
        plan = [(label, method, cfg) for label, method, cfg in ROWS if label in wanted]
        if args.torch_path:
            plan += [(f"{label} [torch]", method, {**cfg, "attention_backend": "torch"})
                     for label, method, cfg in plan if method != "full"]
        for label, method, cfg in plan:
            store = get_resident_method(method, **cfg).new_store(layout)
            if method.startswith("anchor"):
                # AnchorKV reads only the observation window's queries and exact outputs.
                W = store.config.window
                q_obs = torch.randn(Hq, W, d)
                y_obs = torch.nn.functional.scaled_dot_product_attention(
                    q_obs[None], k[None], v[None], scale=scale, enable_gqa=True)[0]
                store.compress_prompt(k, v, q_obs, y_obs, scale)
                store.seq_len = T
            elif method == "streaming":
                store.append(k, v, torch.empty(Hq, T, d))  # StreamingLLM keeps by position: the queries are unused
            else:
                store.scaling = scale
                store.append(k, v)
            # FullKV computes in the query's dtype (SDPA, as transformers): bf16 queries for its bf16 cache, as a
            # bf16 model has; the compressed stores compute in fp32 whatever the query's dtype.
            qs = q.to(store.storage_dtype) if method == "full" else q
            t = median_seconds(lambda: store.attend(qs, k1, v1, scale), args.repeats)
            rows.append((label, t, store.nbytes() + (k1.numel() + v1.numel()) * 2))
        for name, t, b in rows:
            print(f"{T:>7}  {name:<15} {t * 1e3:>8.2f}   {t / dense['dense-bf16'][0]:>12.2f}x"
                  f"  {t / dense['dense-fp32'][0]:>12.2f}x  {b / 2**20:>10.1f}  {b / ref_bytes:>10.3f}")


if __name__ == "__main__":
    main()
