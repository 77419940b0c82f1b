"""End-to-end on the packaged SmolLM2-135M-Instruct (no network): exactness, needle, bytes, CLI."""

import json

import pytest
import torch

from kvpack import attach
from kvpack.generate import encode_prompt, generate
from kvpack.hf.cache import cache_kwargs
from kvpack.prompts import needle_prompt
from kvpack.resident.puzzle import PuzzleConfig, expected_bytes

pytestmark = pytest.mark.model


def test_full_generates_exactly_like_transformers(smollm2):
    model, tok = smollm2
    ids = encode_prompt(tok, "Write one sentence about the sea.", chat=True)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    with attach(model, "full") as cache:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             **cache_kwargs(model, cache))
    assert torch.equal(out, ref)


@pytest.fixture(scope="module")
def needle_2k(smollm2):
    return needle_prompt(smollm2[1], n_tokens=2048, depth=0.5, seed=14)


def test_puzzle_bytes_match_formula_including_dense_regions(smollm2, needle_2k):
    model, tok = smollm2
    prompt, _ = needle_2k
    result = generate(model, tok, prompt, "puzzle", max_new_tokens=8)
    cfg = PuzzleConfig()
    seq = result.prompt_tokens + result.new_tokens - 1
    per_layer = expected_bytes(seq, cfg, 3, 64, 13, 12, 2)  # 3 KV heads, d = 64, bf16
    assert result.kv_bytes == pytest.approx(30 * per_layer, rel=0.01)
    assert result.dense_kv_bytes == 30 * seq * 3 * 64 * 2 * 2
    assert 0.58 < result.ratio < 0.62
    assert (result.config["rank_k"], result.config["rank_v"]) == (13, 12)


@pytest.mark.parametrize("depth,seed", [(0.25, 21), (0.5, 14), (0.75, 22)])
def test_puzzle_at_0_6_retrieves_needle_with_64_token_pages(smollm2, depth, seed):
    """PuzzleKV at a 0.6 budget retrieves a 7-digit needle from ~2K tokens of filler.

    With 64-token pages (ranks chosen for the budget, 18/17). The paper's 32-token pages at the
    derived (13, 12) keep the ratio but lose digits on SmolLM2 (d = 64): see docs/methods/puzzlekv.md and
    benchmarks/bench_needle.py for the measured retrieval of both.
    """
    model, tok = smollm2
    prompt, answer = needle_prompt(tok, n_tokens=2048, depth=depth, seed=seed)
    result = generate(model, tok, prompt, "puzzle", dict(page_size=64, budget=0.6), max_new_tokens=10)
    assert answer in result.text
    assert result.ratio <= 0.6
    full = generate(model, tok, prompt, "full", max_new_tokens=10)
    assert answer in full.text


def test_cli_generate_json(smollm2, capsys):
    from kvpack.cli import main

    assert main(["generate", "--method", "puzzle", "--set", "int4=true", "--prompt", "The capital of France is",
                 "--max-new-tokens", "5", "--json", "--quiet"]) == 0
    row = json.loads(capsys.readouterr().out)
    for key in ("text", "method", "config", "prompt_tokens", "new_tokens", "kv_bytes", "dense_kv_bytes", "ratio"):
        assert key in row
    assert row["method"] == "puzzle" and row["config"]["int4"] is True and row["new_tokens"] == 5
    assert row["ratio"] == pytest.approx(row["kv_bytes"] / row["dense_kv_bytes"])


@pytest.mark.parametrize("method", ["svd", "kivi", "streaming", "h2o", "snapkv"])
def test_baselines_run_through_cli_on_a_2k_needle(smollm2, needle_2k, method, capsys, tmp_path):
    """Each baseline runs through ``kvpack generate --json`` at a 0.25 budget (retrieval is reported
    by benchmarks/bench_baselines_needle.py, not asserted)."""
    from kvpack.cli import main

    prompt_file = tmp_path / "needle.txt"
    prompt_file.write_text(needle_2k[0])
    assert main(["generate", "--method", method, "--budget", "0.25", "--prompt-file", str(prompt_file),
                 "--max-new-tokens", "4", "--json", "--quiet"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["method"] == method and row["new_tokens"] == 4
    # Bytes after generation: within the budget at the end of prefill, plus at most the 3 decode
    # tokens the prompt-compressing methods append dense.
    slack = 3 * 30 * 3 * 64 * 2 * 2
    assert row["kv_bytes"] <= 0.25 * row["dense_kv_bytes"] + slack


@pytest.mark.parametrize("theta", [
    pytest.param(0.1, marks=pytest.mark.xfail(strict=True, reason="measured: faithful AnchorKV loses the needle at "
                                              "θ = 0.1 on SmolLM2 at 2K (0/10 needles); see docs/methods/anchorkv.md")),
    pytest.param(0.05, marks=pytest.mark.xfail(strict=True, reason="measured: 0/10 needles at θ = 0.05 at 2K; "
                                               "see docs/methods/anchorkv.md")),
    0.25,
])
def test_anchor_needle(smollm2, theta):
    """AnchorKV on a ~2K-token needle: the issue's θ = 0.1 and 0.05 are known misses on this model
    (strict xfail: they fail loudly the day they pass); θ = 0.25, where almost every token carries
    a residual, retrieves."""
    model, tok = smollm2
    prompt, answer = needle_prompt(tok, n_tokens=2048, depth=0.4, seed=31)
    result = generate(model, tok, prompt, "anchor", dict(budget=theta), max_new_tokens=10)
    assert result.kv_bytes <= theta * result.dense_kv_bytes + 9 * 30 * 3 * 64 * 2 * 2  # + 9 dense decode tokens
    assert answer in result.text


@pytest.mark.parametrize("theta", [0.1, 0.05])
def test_anchor_needle_with_pooled_ranking_and_narrow_index(smollm2, theta):
    """``anchor_plus``, AnchorKV with the two options beyond the paper (docs/methods/anchorkv.md): ranking by
    the neighbourhood maximum of Eq. 6 and uint8 anchor indices retrieve the needle at the issue's θ,
    within the budget."""
    model, tok = smollm2
    prompt, answer = needle_prompt(tok, n_tokens=2048, depth=0.4, seed=31)
    result = generate(model, tok, prompt, "anchor_plus", dict(budget=theta), max_new_tokens=10)
    assert result.config["residual_pooling"] == 15 and result.config["narrow_index"] is True
    assert result.kv_bytes <= theta * result.dense_kv_bytes + 9 * 30 * 3 * 64 * 2 * 2  # + 9 dense decode tokens
    assert answer in result.text


@pytest.mark.parametrize("mode", ["anchors", "residual4"])
def test_anchor_plus_spends_the_budget_past_saturation(smollm2, mode):
    """Issue 16: past AnchorKV's 2-bit saturation point (0.203 of the dense bytes here) ``anchor_plus``
    spends the budget — on more anchors, or on 4-bit residuals for the top-ranked token-sides — and
    still retrieves, within θ."""
    model, tok = smollm2
    prompt, answer = needle_prompt(tok, n_tokens=2048, depth=0.4, seed=31)
    result = generate(model, tok, prompt, "anchor_plus", dict(budget=0.3, above_saturation=mode), max_new_tokens=10)
    decode_tokens = 9 * 30 * 3 * 64 * 2 * 2  # 9 dense decode tokens, 30 layers
    assert 0.29 * result.dense_kv_bytes <= result.kv_bytes <= 0.3 * result.dense_kv_bytes + decode_tokens
    if mode == "residual4":  # first layer's choice: a partial upgrade at 0.3, default anchors
        assert 0 < result.config["fine_residuals_k"] < 3 * (2048 - result.config["anchors"])
        assert result.config["anchors"] == 32
    else:
        assert result.config["anchors"] > 32
    assert answer in result.text
