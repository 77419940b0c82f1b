"""Bad input is refused with a message naming the problem."""

import json

import pytest
import torch

from kvpack.cli import main
from kvpack.hf.models import load_model
from kvpack.resident import LayerLayout, available_resident_methods, get_resident_method
from kvpack.resident.puzzle import PuzzleConfig


@pytest.mark.parametrize("fields,match", [
    (dict(page_size=0), "page_size must be >= 1"),
    (dict(page_size=-4), "page_size must be >= 1"),
    (dict(page_size=2.5), "page_size must be an integer"),
    (dict(rank_k=0, rank_v=4), "rank_k must be >= 1"),
    (dict(rank_k=4, rank_v=-1), "rank_v must be >= 1"),
    (dict(rank_k=40, rank_v=4), "rank_k must be <= 32"),
    (dict(rank_k=4), "rank_k and rank_v must be set together"),
    (dict(budget=0.0), r"budget must be in \(0, 1\]"),
    (dict(budget=1.5), r"budget must be in \(0, 1\]"),
    (dict(budget=float("nan")), r"budget must be in \(0, 1\]"),
    (dict(budget="half"), "budget must be a number"),
    (dict(budget=0.5, rank_k=4, rank_v=4), "either budget or rank_k"),
    (dict(key_rope="middle"), r"key_rope must be one of \('post', 'pre'\)"),
    (dict(storage_dtype="int8"), "storage_dtype must be one of"),
    (dict(check_finite="no"), "check_finite must be true or false"),
])
def test_invalid_puzzle_config(fields, match):
    with pytest.raises(ValueError, match=match):
        PuzzleConfig(**fields)


def test_rank_above_head_dim_refused_at_store():
    codec = get_resident_method("puzzle", page_size=64, rank_k=40, rank_v=40)
    with pytest.raises(ValueError, match=r"ranks must be <= min\(page_size, head_dim\) = 32"):
        codec.new_store(LayerLayout(layer_idx=0, kv_heads=2, q_heads=2, head_dim=32))


def test_config_json_roundtrip_and_unknown_field():
    cfg = PuzzleConfig(page_size=16, rank_k=6, rank_v=5, int4=True)
    assert PuzzleConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['rank'\]"):
        PuzzleConfig.from_dict({"rank": 3})
    with pytest.raises(ValueError, match="version 99 is not supported"):
        PuzzleConfig.from_dict({"version": 99})
    assert PuzzleConfig.parse_overrides(["page_size=16", "int4=true", "rank_k=none"]) == {
        "page_size": 16, "int4": True, "rank_k": None}
    with pytest.raises(ValueError, match="cannot parse 'x' as int"):
        PuzzleConfig.parse_overrides(["page_size=x"])


def test_unknown_method_and_model():
    with pytest.raises(ValueError, match="unknown method 'nope'; known methods: .*puzzle"):
        get_resident_method("nope")
    assert {"full", "puzzle"} <= set(available_resident_methods())
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


@pytest.fixture
def store():
    return get_resident_method("puzzle", page_size=8, rank_k=2, rank_v=2).new_store(
        LayerLayout(layer_idx=3, kv_heads=2, q_heads=4, head_dim=16))


def test_store_rejects_bad_tensors(store):
    good = torch.randn(2, 10, 16)
    with pytest.raises(ValueError, match=r"keys must be \[kv_heads=2, tokens, head_dim=16\], got \[3, 10, 16\]"):
        store.append(torch.randn(3, 10, 16), torch.randn(3, 10, 16))
    with pytest.raises(ValueError, match="keys .* and values .* must have the same shape"):
        store.append(good, torch.randn(2, 9, 16))
    with pytest.raises(TypeError, match="keys must be a floating-point tensor, got torch.int64"):
        store.append(torch.ones(2, 10, 16, dtype=torch.long), good)
    bad = good.clone()
    bad[1, 4, 2] = float("nan")
    with pytest.raises(ValueError, match="values of layer 3 contain NaN or Inf"):
        store.append(good, bad)
    bad[1, 4, 2] = float("inf")
    with pytest.raises(ValueError, match="keys of layer 3 contain NaN or Inf"):
        store.append(bad, good)
    with pytest.raises(ValueError, match=r"queries must be \[q_heads=4"):
        store.attend(torch.randn(2, 10, 16), good, good, 0.25)
    assert store.seq_len == 0 and store.nbytes() == 0  # nothing half-stored


def test_cli_reports_errors_cleanly(capsys):
    assert main(["generate", "--method", "nope", "--prompt", "hi"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["generate", "--method", "puzzle", "--budget", "2", "--prompt", "hi"]) == 2
    assert "budget must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--model", "nowhere", "--prompt", "hi"]) == 2
    assert "unknown model 'nowhere'" in capsys.readouterr().err
    assert main(["generate", "--method", "puzzle", "--set", "page_size=0", "--prompt", "hi"]) == 2
    assert "page_size must be >= 1" in capsys.readouterr().err
    # the default method (auto) picks the method: a field of some method is refused, naming the way out
    assert main(["generate", "--set", "page_size=64", "--prompt", "hi"]) == 2
    assert "--method auto picks the method, so it takes only --budget" in capsys.readouterr().err
    assert main(["generate", "--budget", "1.5", "--prompt", "hi"]) == 2
    assert "--budget must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(["generate", "--method", "kvtc_resident-8x", "--budget", "0.2", "--prompt", "hi"]) == 2
    assert "kvtc_resident-8x takes no budget: its bytes follow from ratio=8.0" in capsys.readouterr().err


def test_cli_turns_anticipated_errors_into_one_line_and_bugs_into_one_line_without_debug(capsys, monkeypatch):
    """Issue 17, item 7: an empty prompt, a zlib level past 9, a full disk or a bug end in one line
    and a non-zero exit; --debug shows the traceback."""
    import errno

    import kvpack.cli.generation as cli

    assert main(["generate", "--prompt", ""]) == 2
    assert "empty prompt" in capsys.readouterr().err
    assert main(["generate", "--method", "kvtc", "--set", "level=15", "--prompt", "hi"]) == 2
    assert "level must be <= 9 for zlib" in capsys.readouterr().err

    def disk_full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/tmp/out.kvtc")

    def bug(args):
        raise KeyError("oops")

    for fn, rc, text in ((disk_full, 2, "No space left on device"), (bug, 1, "internal error: KeyError")):
        monkeypatch.setattr(cli, "cmd_methods", fn)
        assert main(["methods"]) == rc
        err = capsys.readouterr().err
        assert text in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
        with pytest.raises((OSError, KeyError)):
            main(["--debug", "methods"])


def test_prompt_longer_than_the_context_is_refused_before_running():
    from kvpack.hf.generation import check_context
    from kvpack.methods import get_method

    from .helpers import tiny_llama

    model = tiny_llama()  # max_position_embeddings = 1024
    with pytest.raises(ValueError, match="1020 tokens \\+ 8 to generate exceed the model's context of 1024"):
        get_method("full").generate(model, None, list(range(1020)), max_new_tokens=8)
    with pytest.raises(ValueError, match="exceed the model's context"):
        get_method("puzzle").generate(model, None, list(range(2000)), max_new_tokens=1)
    check_context(model, 1000, 24)  # fits exactly
