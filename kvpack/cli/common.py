"""What the ``kvpack`` commands share: the model and prompt arguments, a method's config from the
command line, loading the model."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from ..hf.half_linear import HALF_PRODUCTS
from ..hf.models import load_model
from ..methods import method_config_class

DTYPES = ("float32", "bfloat16", "float16")


def add_command(sub, name: str, summary: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` starts with its one-line ``summary`` and ends with examples."""
    epilog = "example" + ("s" if len(examples) > 1 else "") + ":\n" + "\n".join(f"  {e}" for e in examples)
    return sub.add_parser(name, help=summary, description=summary, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def method_config(method: str, budget: float | None, sets: list[str], calibration: str | None = None) -> dict:
    """The config fields of ``method`` given on the command line (``--budget``, ``--set K=V``,
    ``--calibration``), typed and checked against the method's config class."""
    config_cls = method_config_class(method)
    config = config_cls.parse_overrides(sets)
    if budget is not None:
        config["budget"] = budget
    if calibration is not None:
        if "calibration" not in {f.name for f in dataclasses.fields(config_cls)}:
            raise ValueError(f"--calibration applies to calibrated methods (kvtc), not to {method!r}")
        config["calibration"] = calibration
    return config


def load(args):
    """``(model, tokenizer)`` from the model arguments (:func:`add_model_args`): ``smollm2``, a model
    directory or a .gguf file, in ``--dtype``, with ``--half-products``."""
    return load_model(args.model, dtype=getattr(torch, args.dtype), half_products=args.half_products,
                      allow_untested=getattr(args, "allow_untested", False))


def read_prompt(args) -> str:
    return Path(args.prompt_file).read_text() if getattr(args, "prompt_file", None) else args.prompt


def add_model_args(p, dtype_default: str = "float32") -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), qwen2.5-0.5b (after scripts/install_models.sh), a model directory or "
                   "a .gguf file")
    p.add_argument("--dtype", default=dtype_default, choices=DTYPES, help=f"model dtype (default {dtype_default})")
    p.add_argument("--allow-untested", action="store_true",
                   help="load a model of a family kvpack has not been tested on (kvpack.hf.families) anyway")
    p.add_argument("--half-products", default="auto", choices=HALF_PRODUCTS,
                   help="a bf16/fp16 model's linear layers on the CPU: auto (default) multiplies long inputs in fp32 "
                        "and rounds back where the CPU has no bf16/fp16 arithmetic, float32 does so on any CPU, "
                        "native keeps torch's kernels")


def add_prompt_args(p, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt")
