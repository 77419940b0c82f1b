"""kvtc on the packaged SmolLM2: calibration on the offline corpus, needle at 16x, multi-turn via the store.

The calibration here is smaller than the CLI default (8K tokens, 1024 components) to keep the suite
fast; ``benchmarks/bench_kvtc.py`` measures the full-size calibration.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvpack.generate import encode_prompt, generate
from kvpack.hf.fingerprint import model_fingerprint
from kvpack.prompts import needle_prompt
from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate
from kvpack.storage.kvtc.coder import compress_cache, decompress_cache
from kvpack.storage.kvtc.session import compress_tokens, continue_from_blob, prefill
from kvpack.store.prefix import PrefixStore

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def calibrated(smollm2, tmp_path_factory):
    model, tok = smollm2
    settings = CalibrationSettings(tokens=8192, chunk_tokens=2048, pca_dim=1024, ratios=(4, 16, 32, 64))
    calib = calibrate(model, tok, settings, progress=False)
    directory = calib.save(tmp_path_factory.mktemp("kvtc") / "smollm2")
    return calib, str(directory)


def _number(text: str) -> str | None:
    m = re.search(r"\d{7}", text)
    return m.group(0) if m else None


def test_calibration_on_offline_corpus(calibrated, smollm2):
    calib, _ = calibrated
    assert calib.features == 30 * 3 * 64
    assert calib.stats["positions_sampled"] == 4 * (2048 - 4 - 128)
    assert calib.fingerprint["hash"] == model_fingerprint(smollm2[0])["hash"]
    for summary in calib.stats["widths"].values():
        for kind in ("keys", "values"):
            assert summary[kind]["used_bits"] <= summary[kind]["budget_bits"]
    # Widths fall with the component index where the budget binds (monotonicity itself is what
    # ``benchmarks/bench_kvtc.py`` reports for the full-size calibration). At 4x all 1024 components fit at 8 bits and
    # the DP spends the surplus on 1-wide groups, which the fp16 shift makes lossless at any width.
    for key, pair in calib.allocations.items():
        if float(key) < 16:
            continue
        for kind, alloc in pair.items():
            w = alloc.widths()
            quarter = len(w) // 4
            assert w[:quarter].mean() > w[-quarter:].mean(), (key, kind)


def test_kv_error_falls_as_ratio_relaxes(calibrated, smollm2):
    model, tok = smollm2
    calib, _ = calibrated
    prompt, _ = needle_prompt(tok, n_tokens=1024, depth=0.5, seed=3)
    ids = tok(prompt).input_ids
    cache = prefill(model, ids)
    errors = []
    for ratio in (64, 32, 16, 4):
        restored, _ = decompress_cache(compress_cache(cache, calib, ratio, ids, model=model), calib, model)
        err = sum(float((a.keys - b.keys).pow(2).sum()) for a, b in zip(restored.layers, cache.layers))
        errors.append(err / sum(float(b.keys.pow(2).sum()) for b in cache.layers))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.05, errors


def test_needle_retrieved_at_16x(calibrated, smollm2):
    model, tok = smollm2
    _, directory = calibrated
    prompt, answer = needle_prompt(tok, n_tokens=2048, depth=0.4, seed=21)
    result = generate(model, tok, prompt, "kvtc", {"calibration": directory, "ratio": 16}, max_new_tokens=10)
    assert answer in result.text, result.text
    # The blob, header and lossless sink/window included, is far below the dense bf16 cache.
    assert result.kv_bytes < result.dense_kv_bytes / 5


def test_second_turn_continues_from_stored_first_turn(calibrated, smollm2, tmp_path):
    model, tok = smollm2
    calib, _ = calibrated
    prompt, answer = needle_prompt(tok, n_tokens=2048, depth=0.6, seed=5)
    ids = encode_prompt(tok, prompt)[0].tolist()
    question_at = len(tok(prompt[: prompt.index("\nWhat is")]).input_ids)
    turn1 = ids[:question_at]
    assert ids[:question_at] == turn1 and question_at < len(ids) - 5
    store = PrefixStore(tmp_path)
    store.put(compress_tokens(model, calib, turn1, 16), turn1)
    found = store.longest_prefix(model_fingerprint(model)["hash"], calib.calibration_id, ids[:-1])
    assert found is not None and found[0] == len(turn1)
    n, blob = found
    cont = continue_from_blob(model, tok, calib, blob, ids[n:], max_new_tokens=10)
    assert cont.restored_tokens == n and cont.prefilled_tokens == len(ids) - n
    x = torch.tensor([ids])
    recomputed = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                                pad_token_id=tok.pad_token_id)
    recomputed_text = tok.decode(recomputed[0, len(ids):], skip_special_tokens=True)
    assert _number(cont.text) == _number(recomputed_text) == answer, (cont.text, recomputed_text)


def test_cli_compress_continue_decompress_and_store(calibrated, tmp_path, capsys):
    from kvpack.cli import main

    _, directory = calibrated
    prompt = "Alice keeps her spare key under the blue flowerpot. " * 30
    blob = tmp_path / "turn1.kvtc"
    assert main(["compress", "--calibration", directory, "--ratio", "16", "--prompt", prompt, "--out", str(blob)]) == 0
    assert blob.stat().st_size > 0
    assert main(["continue", "--calibration", directory, "--blob", str(blob), "--prompt",
                 " Question: where is the spare key? Answer: under the", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["restored_tokens"] > 300 and out["kv_bytes"] == blob.stat().st_size
    dense = tmp_path / "cache.safetensors"
    assert main(["decompress", "--calibration", directory, "--blob", str(blob), "--out", str(dense)]) == 0
    from safetensors.torch import load_file

    tensors = load_file(str(dense))
    assert tensors["layer0.keys"].shape[1] == out["restored_tokens"] and len(tensors) == 1 + 2 * 30
    store = tmp_path / "store"
    assert main(["compress", "--calibration", directory, "--ratio", "16", "--prompt", prompt,
                 "--store", str(store)]) == 0
    assert main(["continue", "--calibration", directory, "--store", str(store), "--prompt",
                 prompt + " Question: where is the spare key?", "--max-new-tokens", "4", "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["restored_tokens"] == out["restored_tokens"] and again["prefilled_tokens"] >= 1
    # Bad input at the command line: a clear error and exit code 2, no traceback.
    blob.write_bytes(blob.read_bytes()[:100])
    assert main(["continue", "--calibration", directory, "--blob", str(blob), "--prompt", "x"]) == 2
    assert "truncated" in capsys.readouterr().err
    assert main(["compress", "--calibration", directory, "--ratio", "12", "--prompt", "x", "--out", str(blob)]) == 2
    assert "no bit allocation for ratio 12" in capsys.readouterr().err


def test_cli_processes_refuse_hostile_blobs_and_unwritable_outputs(calibrated, smollm2, tmp_path):
    """Issue 17, items 2 and 7 through real `kvpack` processes: a well-checksummed blob with a
    hostile header, and an output path that cannot be written, end in one line and exit 2."""
    from .helpers import join_blob, run_kvpack, split_blob

    model, tok = smollm2
    calib, directory = calibrated
    ids = tok("Alice keeps her spare key under the blue flowerpot. " * 20).input_ids
    header, data = split_blob(compress_tokens(model, calib, ids, 16))
    header["cache_dtype"] = "int8"  # before: keys decoded as int8 garbage and a garbage continuation
    hostile = tmp_path / "hostile.kvtc"
    hostile.write_bytes(join_blob(header, data))
    for args in (["continue", "--blob", str(hostile), "--prompt", " Where is the key?"],
                 ["decompress", "--blob", str(hostile), "--out", str(tmp_path / "cache.safetensors")]):
        run = run_kvpack([*args, "--calibration", directory], cwd=tmp_path)
        last = run.stderr.strip().splitlines()[-1]  # progress lines of the model's loading come before
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert last.startswith("kvpack: error: ") and "'cache_dtype' must be one of" in last, run.stderr
    assert not (tmp_path / "cache.safetensors").exists()
    run = run_kvpack(["compress", "--calibration", directory, "--ratio", "16", "--prompt", "hello there",
                      "--out", "/proc/no-such-dir/turn1.kvtc"], cwd=tmp_path)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert last.startswith("kvpack: error: ") and "No such file or directory" in last, run.stderr


@pytest.mark.parametrize("chat,turn1_end", [(True, ""), (False, " ")])
def test_cli_second_turn_reuses_the_first_through_the_store(calibrated, tmp_path, capsys, chat, turn1_end):
    """Issue 17, item 8: `compress --chat --store` then `continue --chat --store` with the conversation
    so far (and the same without a template for a turn 1 ending in whitespace) reuse turn 1: before,
    both said "no stored prefix" (the template's closing tokens / the space are not a prefix of turn 2)."""
    from kvpack.cli import main

    _, directory = calibrated
    turn1 = "Alice keeps her spare key under the blue flowerpot. " * 12 + "Remember it." + turn1_end
    flags = ["--chat"] if chat else []
    store = str(tmp_path / "store")
    assert main(["compress", "--calibration", directory, "--ratio", "16", "--prompt", turn1, "--store", store,
                 *flags]) == 0
    capsys.readouterr()
    turn2 = turn1.rstrip() + " Where is the spare key?"
    assert main(["continue", "--calibration", directory, "--store", store, "--prompt", turn2,
                 "--max-new-tokens", "8", "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["restored_tokens"] > 100 and 1 <= out["prefilled_tokens"] <= 20, out
