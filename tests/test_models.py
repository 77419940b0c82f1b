"""Offline model resolution and loading (no network)."""

import pytest

from kvpack.hf.models import gguf_cache_path, load_model, resolve_model_source
from kvpack.paths import cache_dir


def test_resolution_of_names_files_and_directories(tmp_path, monkeypatch):
    kind, path = resolve_model_source("smollm2")
    assert kind == "gguf" and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source(str(gguf)) == ("gguf", gguf)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path / "model")) == ("hf_dir", tmp_path / "model")
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_source(str(tmp_path))  # a directory without config.json
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    assert gguf_cache_path(gguf).parent == tmp_path / "cache" / "models"


@pytest.mark.model
def test_local_directory_loads_like_the_packaged_name(smollm2):
    """The converted cache directory is an ordinary Hugging Face model directory."""
    model, _ = smollm2
    directory = gguf_cache_path(resolve_model_source("smollm2")[1])
    again, tok = load_model(str(directory))
    assert type(again) is type(model) and tok.pad_token_id is not None
    assert all((a == b).all() for a, b in zip(again.state_dict().values(), model.state_dict().values()))
