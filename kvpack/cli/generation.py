"""``kvpack generate`` (one measured generation with any method), ``kvpack methods`` (every method's
fields) and ``kvpack demo`` (one needle: FullKV, kvpack's default and the faithful PuzzleKV, in about a minute)."""

from __future__ import annotations

import json
import sys

from ..generate import generate
from ..hf.models import load_model
from ..hf.whole_budget import BUDGET_SCOPES
from ..methods import available_methods, available_presets, get_method, method_config_class
from ..methods.recommend import AUTO, DEFAULT_BUDGET, resolve_auto
from ..presets import PRESETS
from ..prompts import needle_prompt
from .common import add_command, add_model_args, add_prompt_args, load, method_config, read_prompt


def cmd_generate(args) -> int:
    auto = args.method == AUTO
    if auto:
        if args.set or args.calibration:
            raise ValueError("--method auto picks the method, so it takes only --budget; name a method (kvpack "
                             "methods) to use --set or --calibration")
        if args.budget is not None and not 0 < args.budget <= 1:
            raise ValueError(f"--budget must be in (0, 1], got {args.budget:g}")
    else:  # validate before loading the model
        method = get_method(args.method, **method_config(args.method, args.budget, args.set, args.calibration))
        method.check_ready()
    prompt = read_prompt(args)
    if not prompt:
        raise ValueError("empty prompt: nothing to generate from")
    model, tokenizer = load(args)
    recommendation = None
    if auto:
        name, config, recommendation = resolve_auto(model, AUTO, {} if args.budget is None else {"budget": args.budget})
        if not args.quiet:
            print(recommendation.announcement(), file=sys.stderr, flush=True)
        method = get_method(name, **config)
    result = generate(model, tokenizer, prompt, method, chat=args.chat,
                      max_new_tokens=args.max_new_tokens, progress=not args.quiet, budget_scope=args.budget_scope)
    if args.json:
        out = result.to_dict()
        if recommendation is not None:
            out["recommendation"] = recommendation.to_dict()
        print(json.dumps(out))
    else:
        print(result.text)
        print(f"\n[{result.method}] KV bytes {result.kv_bytes:,} vs dense bf16 {result.dense_kv_bytes:,} "
              f"(ratio {result.ratio:.3f}); prompt {result.prompt_tokens} tokens, {result.new_tokens} new",
              file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    """Needle-in-filler generation with FullKV, kvpack's default at 0.28 of the bytes and the faithful PuzzleKV,
    printed side by side with measured bytes."""
    model, tokenizer = load_model(args.model)
    prompt, answer = needle_prompt(tokenizer, n_tokens=args.tokens, depth=0.4, seed=7)
    print(f"needle-in-filler prompt: {args.tokens} tokens, hidden number {answer}\n")
    default, default_config, rec = resolve_auto(model, AUTO, {"budget": DEFAULT_BUDGET})
    print(f"kvpack's default at {DEFAULT_BUDGET:g} of the bytes: {default} — {rec.reason}\n")
    rows = []
    # FullKV; the default; the PuzzleKV paper's own setting (P = 32, ranks derived for d)
    for name, config in (("full", {}), (default, default_config), ("puzzle", {})):
        r = generate(model, tokenizer, prompt, get_method(name, **config), max_new_tokens=args.max_new_tokens,
                     progress=True)
        rows.append(r)
        found = "yes" if answer in r.text else "no"
        print(f"{r.method}: {r.text.strip()!r}  (needle retrieved: {found})")
    print("\nmethod               KV bytes   dense bf16   ratio  prefill s  total s")
    for r in rows:
        print(f"{r.method:<18} {r.kv_bytes:>11,} {r.dense_kv_bytes:>12,}  {r.ratio:>6.3f}  {r.prefill_s:>9.1f}"
              f"  {r.total_s:>7.1f}")
    print("\n(full keeps the model's fp32 cache, hence a ratio of 2 against the bf16 reference.)")
    return 0


def cmd_methods(args) -> int:
    """Every method with its family and config fields (defaults, allowed values), then every preset."""
    print(f"{AUTO}: the frontier's best resident method at --budget (default {DEFAULT_BUDGET:g}) for the model, "
          "for caches reused across questions; the default of kvpack generate and kvpack.attach")
    for name in available_methods():
        method = get_method(name)
        print(f"{name} ({method.family})")
        for line in method_config_class(name).help_lines():
            print(f"    {line}")
    print("\npresets (a method with fields fixed; any other field may still be set):")
    for p in PRESETS:
        fields = ", ".join(f"{k}={v}" for k, v in p.config.items())
        budget = "takes --budget" if p.budgeted else "fixed bytes"
        print(f"{p.name} = {p.method} {fields} ({budget}{'; retired' if p.retired else ''}): {p.summary}")
    return 0


def add_parsers(sub) -> None:
    g = add_command(sub, "generate", "generate with a compressed KV cache and report its measured bytes",
                    "kvpack generate --budget 0.28 --prompt-file long.txt --json",
                    "kvpack generate --method pca_quant-layers --budget 0.15 --prompt-file long.txt",
                    'kvpack generate --method anchor --set recompress_every=256 --prompt "..." --chat')
    add_model_args(g)
    g.add_argument("--method", default=AUTO, metavar="METHOD",
                   help=f"{AUTO} (default: the frontier's best resident method at --budget for this model), a method "
                   f"({', '.join(available_methods())}) or a preset ({', '.join(available_presets())}); "
                   "`kvpack methods` lists each one's fields and defaults")
    g.add_argument("--budget", type=float, default=None,
                   help=f"target fraction of the dense bf16 KV bytes of the whole cache (--method {AUTO}: default "
                   f"{DEFAULT_BUDGET:g})")
    g.add_argument("--budget-scope", default="whole", choices=BUDGET_SCOPES,
                   help="whole (default): the budget covers every layer, a model's sliding-window layers charged to "
                   "the compressed ones; full_layers: the full-attention layers alone")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field of the method (see `kvpack methods`)")
    g.add_argument("--calibration", default=None, help="calibration directory (kvtc)")
    add_prompt_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")
    g.set_defaults(func=cmd_generate)

    m = add_command(sub, "methods", "list every method with its config fields, defaults and allowed values",
                    "kvpack methods")
    m.set_defaults(func=cmd_methods)

    d = add_command(sub, "demo", "one needle with FullKV, kvpack's default and the faithful PuzzleKV (about a minute)",
                    "HF_HUB_OFFLINE=1 kvpack demo")
    d.add_argument("--model", default="smollm2")
    d.add_argument("--tokens", type=int, default=2048)
    d.add_argument("--max-new-tokens", type=int, default=12)
    d.set_defaults(func=cmd_demo)
