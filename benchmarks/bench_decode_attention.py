"""One decode step of attention over a PuzzleKV layer vs dense SDPA over the same tokens.

Llama-8B head shape (8 KV heads, 32 query heads, d = 128), synthetic keys/values with a decaying
spectrum, batch 1, contexts 16K and 32K. Reports the median time of one decode attention (the
store's attend(), which merges sink, factorized pages, window and the new token) against
``torch.nn.functional.scaled_dot_product_attention`` over the dense cache (bf16 and fp32), and
the bytes each holds. On CPU this measures the PyTorch path; GPU kernels are a separate issue.

Usage: python benchmarks/bench_decode_attention.py [--contexts 16384,32768]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _util import machine, median_seconds

from kvpack.ops.rope import LlamaRotary, RotaryTable
from kvpack.resident import LayerLayout, get_codec


def synthetic_kv(H: int, T: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -1.5, d)
    k = (torch.randn(H, T, d, generator=g) * spectrum) @ torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    v = (torch.randn(H, T, d, generator=g) * spectrum) @ torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    return k, v


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="16384,32768")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    H, Hq, d = 8, 32, 128
    scale = d ** -0.5
    print(f"# bench_decode_attention  ({machine()})")
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
                             rope=RotaryTable(LlamaRotary(d, theta=500000.0), d))
        for label, method, cfg in (("puzzle (16,14)", "puzzle", {}), ("puzzle int4", "puzzle", {"int4": True}),
                                   ("anchor θ=0.1", "anchor", {"budget": 0.1}),
                                   ("anchor θ=0.05", "anchor", {"budget": 0.05})):
            store = get_codec(method, **cfg).new_store(layout)
            if method == "anchor":
                # AnchorKV reads only the observation window's queries and exact outputs.
                W = store.config.window
                q_obs = torch.randn(Hq, W, d)
                y_obs = torch.nn.functional.scaled_dot_product_attention(
                    q_obs[None], k[None], v[None], scale=scale, enable_gqa=True)[0]
                store.compress_prompt(k, v, q_obs, y_obs, scale)
                store.seq_len = T
            else:
                store.append(k, v)
            t = median_seconds(lambda: store.attend(q, k1, v1, scale), args.repeats)
            rows.append((label, t, store.nbytes() + (k1.numel() + v1.numel()) * 2))
        for name, t, b in rows:
            print(f"{T:>7}  {name:<15} {t * 1e3:>8.2f}   {t / dense['dense-bf16'][0]:>12.2f}x"
                  f"  {t / dense['dense-fp32'][0]:>12.2f}x  {b / 2**20:>10.1f}  {b / ref_bytes:>10.3f}")


if __name__ == "__main__":
    main()
