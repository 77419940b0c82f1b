"""kvtc's storage commands: ``calibrate`` (once per model), ``compress`` (a prompt -> a blob file or
a prefix-store entry), ``decompress`` (a blob -> dense cache tensors in safetensors) and
``continue`` (a blob or store entry + new text -> a measured generation). Each builds the method
once (``get_method("kvtc", ...)``) and goes through the storage protocol (``StorageMethod``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..generate import encode_prompt
from ..methods import get_method
from ..methods.layer_profile import PROFILE_BUDGETS, PROFILED_METHODS, profile_layers
from ..storage.kvtc.calibration import CalibrationSettings, calibrate
from ..store import open_prefix_store
from ..store.atomic import atomic_write_bytes
from ..store.format import BACKENDS
from .common import add_command, add_model_args, add_prompt_args, load, read_prompt

CALIBRATION_DEFAULTS = CalibrationSettings()  # the defaults `kvpack calibrate` shows and uses
LAYER_PROFILE_CHUNK_TOKENS = 4096  # a layer profile's chunks: the frontier's shorter length
KVTC_DEFAULTS = get_method("kvtc").config


def _parse_ratios(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ratios expects comma-separated numbers, got {text!r}") from None


def cmd_calibrate(args) -> int:
    """kvtc calibration (PCA + DP allocations) or a resident method's layer profile, written to --out."""
    if args.method != "kvtc":
        return _calibrate_layer_profile(args)
    chunk_tokens = args.chunk_tokens or CALIBRATION_DEFAULTS.chunk_tokens
    settings = CalibrationSettings(tokens=args.tokens, chunk_tokens=chunk_tokens, pca_dim=args.pca_dim,
                                   ratios=_parse_ratios(args.ratios), seed=args.seed, key_rope=args.key_rope,
                                   layer_group=args.layer_group, key_layer_group=args.key_layer_group)
    model, tokenizer = load(args)
    calib = calibrate(model, tokenizer, settings, progress=not args.quiet)
    calib.save(args.out)
    t = calib.stats["timings"]
    print(f"calibration {calib.calibration_id} written to {args.out}: {calib.stats['chunks']} chunks of "
          f"{settings.chunk_tokens} tokens, p = {calib.features} features, {calib.stats['positions_sampled']} "
          f"positions; prefill {t['prefill_s']:.1f} s, PCA {t['pca_keys_s'] + t['pca_values_s']:.1f} s, "
          f"DP {t['dp_keys_s'] + t['dp_values_s']:.1f} s, total {t['total_s']:.1f} s")
    for key, summary in calib.stats["widths"].items():
        k, v = summary["keys"], summary["values"]
        print(f"  ratio {key:>4}: keys {k['coded_components']} components ({k['groups']} groups, max {k['max_width']} "
              f"bits), values {v['coded_components']} ({v['groups']} groups, max {v['max_width']} bits)")
    return 0


def _calibrate_layer_profile(args) -> int:
    """A layer profile (``kvpack.methods.layer_profile``): each layer's KL alone at a grid of budgets."""
    model, tokenizer = load(args)
    profile = profile_layers(model, tokenizer, args.method, chunks=args.chunks,
                             chunk_tokens=args.chunk_tokens or LAYER_PROFILE_CHUNK_TOKENS,
                             continuation=args.continuation, progress=not args.quiet)
    path = profile.save(args.out)
    print(f"layer profile of {args.method} written to {path}: {len(profile.layers)} layers x {len(profile.budgets)} "
          f"budgets, {args.chunks} chunks, {profile.stats['seconds']:.0f} s")
    at = profile.budgets.index(0.15) if 0.15 in profile.budgets else len(profile.budgets) // 2
    ranked = sorted(zip(profile.layers, (row[at] for row in profile.kl)), key=lambda x: -x[1])
    print(f"  KL of one layer coded at {profile.budgets[at]:g}, the largest: "
          + ", ".join(f"layer {layer} {kl:.2g}" for layer, kl in ranked[:6]))
    for budget in (0.28, 0.15, 0.1):
        shares = profile.allocate(budget)
        print(f"  budget {budget:g}: layers get {min(shares.values()):.4g}–{max(shares.values()):.4g}")
    return 0


def _kvtc(args, **config):
    """The kvtc method of the command: its settings refused now if bad, before anything is read."""
    return get_method("kvtc", calibration=args.calibration, **config)


def _ready_with_model(args, method, compressing: bool = False):
    """``(model, tokenizer)``, the method's calibration loaded and checked before the model is."""
    method.check_ready(compressing=compressing)
    model, tokenizer = load(args)
    method.check_model(model)
    return model, tokenizer


def cmd_compress(args) -> int:
    """Prefill a prompt, compress its cache with kvtc, write a blob file or a prefix-store entry."""
    if bool(args.out) == bool(args.store):
        raise ValueError("give exactly one of --out FILE or --store [DIR]")
    method = _kvtc(args, ratio=args.ratio, backend=args.backend, level=args.level)
    prompt = read_prompt(args)
    if not prompt:
        raise ValueError("empty prompt: nothing to compress")
    model, tokenizer = _ready_with_model(args, method, compressing=True)
    ids = encode_prompt(tokenizer, prompt, args.chat)[0].tolist()
    blob = method.compress(model, ids)
    if args.out:
        atomic_write_bytes(args.out, blob)
        where = args.out
    else:
        where = str(open_prefix_store(None if args.store is True else args.store).put(blob, ids))
    dense = method.dense_bytes(blob)
    print(f"{len(ids)} tokens -> {len(blob):,} bytes (dense bf16 {dense:,}, ratio {dense / len(blob):.2f}x) in {where}")
    return 0


def cmd_decompress(args) -> int:
    """A blob back to dense cache tensors (safetensors: layer{i}.keys / layer{i}.values, token_ids)."""
    method = _kvtc(args)
    model, _ = _ready_with_model(args, method)
    cache, ids = method.decompress(model, Path(args.blob).read_bytes())
    tensors = {"token_ids": torch.tensor(ids, dtype=torch.int64)}
    for i, layer in enumerate(cache.layers):
        tensors[f"layer{i}.keys"] = layer.keys[0].contiguous()
        tensors[f"layer{i}.values"] = layer.values[0].contiguous()
    save_file(tensors, args.out)
    print(f"{len(ids)} tokens, {len(cache.layers)} layers written to {args.out}")
    return 0


def cmd_continue(args) -> int:
    """Generation continued from a blob (+ new text) or from the longest stored prefix of a prompt."""
    if bool(args.blob) == bool(args.store):
        raise ValueError("give exactly one of --blob FILE or --store [DIR]")
    text = read_prompt(args)
    if not text:
        raise ValueError("empty prompt: give the new text (--blob) or the whole conversation (--store)")
    method = _kvtc(args)
    model, tokenizer = _ready_with_model(args, method)
    if args.blob:
        blob = Path(args.blob).read_bytes()  # verified when read
        new = tokenizer(text, add_special_tokens=False).input_ids
        result = method.resume(model, tokenizer, blob, new, args.max_new_tokens)
    else:
        store = open_prefix_store(None if args.store is True else args.store)
        ids = encode_prompt(tokenizer, text, args.chat)[0].tolist()
        result = method.resume_from_store(store, model, tokenizer, ids, args.max_new_tokens)
        if result is None:
            raise ValueError("no stored prefix of this prompt for this model and calibration "
                             "(store one with `kvpack compress --store`)")
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(f"\n[kvtc] restored {result.restored_tokens} tokens from {result.kv_bytes:,} bytes "
              f"(dense bf16 {result.dense_kv_bytes:,}) in {result.restore_s:.2f} s, prefilled "
              f"{result.prefilled_tokens} new tokens; first token after {result.prefill_s:.2f} s", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    c = add_command(sub, "calibrate", "calibrate a model once: kvtc's PCA bases and bit allocations, or a "
                    "resident method's layer profile (--method pca_quant)",
                    "kvpack calibrate --out cal/",
                    "kvpack calibrate --key-rope post --out cal-post/   # for engines' chunks (LMCache)",
                    "kvpack calibrate --method pca_quant --out cal-pca/   # then --set calibration=cal-pca/")
    add_model_args(c, "bfloat16")
    c.add_argument("--out", required=True, help="directory to write the calibration to")
    c.add_argument("--method", default="kvtc", choices=("kvtc", *PROFILED_METHODS),
                   help="kvtc (default), or a resident method to profile layer by layer: each layer's KL to "
                   f"the exact cache when it alone is coded, at budgets {', '.join(f'{b:g}' for b in PROFILE_BUDGETS)}")
    cal = CALIBRATION_DEFAULTS
    c.add_argument("--tokens", type=int, default=cal.tokens, help="kvtc: calibration tokens (default %(default)s)")
    c.add_argument("--chunk-tokens", type=int, default=None,
                   help=f"tokens per calibration sequence (default: kvtc {cal.chunk_tokens}, a layer profile "
                   f"{LAYER_PROFILE_CHUNK_TOKENS})")
    c.add_argument("--chunks", type=int, default=2, help="layer profile: calibration sequences (default %(default)s)")
    c.add_argument("--continuation", type=int, default=64,
                   help="layer profile: tokens after each sequence the KL is taken over (default %(default)s)")
    c.add_argument("--pca-dim", type=int, default=cal.pca_dim,
                   help="principal components computed (default %(default)s)")
    c.add_argument("--ratios", default=",".join(f"{r:g}" for r in cal.ratios),
                   help="target ratios to allocate bits for (default %(default)s)")
    c.add_argument("--seed", type=int, default=cal.seed, help="(default %(default)s)")
    c.add_argument("--key-rope", default=cal.key_rope, choices=("pre", "post"),
                   help="keys in the PCA before RoPE (the paper; default %(default)s) or as cached (post: for "
                   "engines' chunks, whose positions are unknown, e.g. the LMCache serde)")
    c.add_argument("--layer-group", type=int, default=None,
                   help="kvtc: one PCA basis per this many consecutive layers (default: one over every layer, the "
                        "paper's; kvtc_resident rebuilds a layer from its block alone)")
    c.add_argument("--key-layer-group", type=int, default=None,
                   help="kvtc: the keys' own --layer-group (default: as --layer-group). 1 = a basis per layer for the "
                        "keys, values cross-layer: kvtc_resident rebuilds a layer's keys from its own components")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    k = add_command(sub, "compress", "kvtc: prefill a prompt and compress its cache to a blob or the store",
                    "kvpack compress --calibration cal/ --ratio 16 --prompt-file turn1.txt --out turn1.kvtc",
                    "kvpack compress --calibration cal/ --ratio 16 --prompt-file turn1.txt --store redis://127.0.0.1:6379/0")
    add_model_args(k, "bfloat16")
    k.add_argument("--calibration", required=True, help="directory written by `kvpack calibrate`")
    k.add_argument("--ratio", type=float, default=KVTC_DEFAULTS.target_ratio,
                   help="a calibrated target ratio (default %(default)g)")
    k.add_argument("--backend", default=KVTC_DEFAULTS.backend, choices=BACKENDS,
                   help="entropy coder (default %(default)s)")
    k.add_argument("--level", type=int, default=KVTC_DEFAULTS.level,
                   help="entropy coder level (default %(default)s; zlib 0-9, zstd 0-22)")
    add_prompt_args(k)
    k.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    dest = k.add_mutually_exclusive_group()
    dest.add_argument("--out", help="blob file to write")
    dest.add_argument("--store", nargs="?", const=True, metavar="DIR|redis://HOST:PORT/DB",
                      help="put the blob in the prefix store: the default directory, DIR, or a Redis server "
                      "(redis://host:port/db[?ttl=SECONDS])")
    k.set_defaults(func=cmd_compress)

    x = add_command(sub, "decompress", "kvtc: a blob back to dense cache tensors (safetensors)",
                    "kvpack decompress --calibration cal/ --blob turn1.kvtc --out cache.safetensors")
    add_model_args(x, "bfloat16")
    x.add_argument("--calibration", required=True)
    x.add_argument("--blob", required=True, help="blob file")
    x.add_argument("--out", required=True, help="safetensors file to write")
    x.set_defaults(func=cmd_decompress)

    n = add_command(sub, "continue", "kvtc: generate after a blob (+ new text) or the longest stored prefix",
                    'kvpack continue --calibration cal/ --blob turn1.kvtc --prompt "Question: ..."',
                    "kvpack continue --calibration cal/ --store --prompt-file turn2.txt")
    add_model_args(n, "bfloat16")
    n.add_argument("--calibration", required=True)
    src = n.add_mutually_exclusive_group()
    src.add_argument("--blob", help="blob file; the prompt is the new text after it")
    src.add_argument("--store", nargs="?", const=True, metavar="DIR|redis://HOST:PORT/DB",
                     help="prefix store (the default directory, DIR, or redis://host:port/db); the prompt is "
                     "the whole conversation, its longest stored prefix is restored")
    add_prompt_args(n)
    n.add_argument("--chat", action="store_true", help="(with --store) wrap the prompt in the chat template")
    n.add_argument("--max-new-tokens", type=int, default=32)
    n.add_argument("--json", action="store_true")
    n.set_defaults(func=cmd_continue)
