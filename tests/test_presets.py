"""Presets (one table), calibrations made for the user, and the recommended cache by default.

The front door: every label the frontier's results use is a name ``--method``, ``kvpack eval``,
:func:`kvpack.get_method` and :func:`kvpack.attach` accept; ``calibration="auto"`` becomes the model's own
calibration (shipped, cached by fingerprint, or made now); ``method="auto"`` (and no method) is the frontier's
best resident method at the budget, with its reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpack
from kvpack.eval.runner import method_specs
from kvpack.methods import available_methods, available_presets, get_method, method_config_class, method_takes_budget
from kvpack.methods import calibrations as cal
from kvpack.methods.recommend import load_choices, recommend, resolve_auto
from kvpack.presets import AUTO_CALIBRATION, PRESETS, auto_calibration_settings, is_auto_calibration

from .helpers import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUTSIDE_KVPACK = ("llamacpp", "kvpress")  # peers run from their own environments, not kvpack methods
sys.path.insert(0, str(ROOT / "benchmarks"))


def frontier_cells() -> list[dict]:
    cells = []
    for path in sorted(RESULTS.glob("frontier-*.json")):
        cells += json.loads(path.read_text())["cells"]
    return cells


# -- one table ---------------------------------------------------------------------------------


def test_every_frontier_label_resolves_through_get_method_the_cli_and_kvpack_methods(capsys):
    from kvpack.cli import main
    from kvpack.cli.common import method_config

    labels = {(c["method"], c["family"], c["budget"], json.dumps(c["overrides"], sort_keys=True))
              for c in frontier_cells() if c["family"] not in OUTSIDE_KVPACK}
    assert len({label for label, *_ in labels}) >= 25  # both models' kvpack cells, the presets among them
    assert main(["methods"]) == 0
    listed = capsys.readouterr().out
    for label, family, budget, overrides in sorted(labels, key=str):
        config = method_config(label, budget, [])  # what `kvpack generate --method LABEL --budget B` builds
        method = get_method(label, **config)
        assert method.name == family and method.label == label
        # the preset's fields are the fields the frontier's rows ran with (the calibration: the model's own)
        for key, value in json.loads(overrides).items():
            got = getattr(method.config, key)
            assert got == value or (key == "calibration" and is_auto_calibration(got)), (label, key)
        assert any(line.startswith(f"{label} ") for line in listed.splitlines()), label


def test_the_frontier_runner_reads_its_presets_from_the_table():
    from frontier import frontier_specs

    specs = frontier_specs([0.28, 0.15], "cal", "profile")
    named = {s.name: s for s in specs if s.name}
    assert set(named) == {p.name for p in PRESETS if not p.retired}
    for p in PRESETS:
        if p.retired:
            continue
        spec = named[p.name]
        assert spec.method == p.method and (spec.budget is not None) == p.budgeted
        assert {k: v for k, v in spec.config.items() if k != "calibration"} == \
            {k: v for k, v in p.config.items() if k != "calibration"}
        assert ("calibration" in spec.config) == p.needs_calibration
    # without a kvtc calibration the kvtc presets are left out, not run with "auto"
    assert not any(s.method.startswith("kvtc") for s in frontier_specs([0.28], None, "profile"))


def test_presets_in_eval_specs_and_their_errors():
    specs = method_specs(["pca_quant-layers", "kvtc_resident-8x", "full"], [0.28, 0.15])
    assert [(s.method, s.budget, s.name) for s in specs] == [
        ("pca_quant", 0.28, "pca_quant-layers"), ("pca_quant", 0.15, "pca_quant-layers"),
        ("kvtc_resident", None, "kvtc_resident-8x"), ("full", None, None)]
    assert specs[0].config == {"calibration": AUTO_CALIBRATION}
    with pytest.raises(ValueError, match="kvtc_resident-8x takes no budget"):
        get_method("kvtc_resident-8x", budget=0.2)
    with pytest.raises(ValueError, match="unknown method 'pca_quant-nope'.*pca_quant-layers"):
        get_method("pca_quant-nope")
    assert method_config_class("pca_quant-salient") is method_config_class("pca_quant")
    # a preset's fixed field may still be overridden (the caller's own layer profile)
    assert get_method("pca_quant-layers", budget=0.2, calibration="mine/").config.calibration == "mine/"


def test_one_spelling_of_the_settings():
    import _peers

    from kvpack.eval.runner import SETTINGS

    assert _peers.SETTINGS == SETTINGS == ("query-aware", "query-agnostic")
    assert set(load_choices()["models"]["smollm2"]["settings"]) == set(SETTINGS)
    assert {c["setting"] for c in frontier_cells()} == set(SETTINGS)


def test_auto_calibration_strings():
    assert auto_calibration_settings("auto") == {}
    assert auto_calibration_settings("auto:key_layer_group=1") == {"key_layer_group": 1}
    with pytest.raises(ValueError, match="expected key=value"):
        auto_calibration_settings("auto:key_layer_group")
    with pytest.raises(ValueError, match="not kvtc calibration settings"):
        cal.calibration_need("kvtc_resident", "auto:bogus=1")
    with pytest.raises(ValueError, match="takes no calibration"):
        cal.calibration_need("kivi", "auto")
    # a loader below the entry points that know the model refuses "auto", naming the way out
    model = tiny_llama()
    with pytest.raises(ValueError, match="is the model's own calibration, made when kvpack.attach"):
        kvpack.KVPackCache(model, "pca_quant", budget=0.3, calibration="auto")
    need = cal.calibration_need("kvtc_resident", "auto:key_layer_group=1", 8.0)
    assert need.directory_name() == "kvtc-key_layer_group=1" and 8.0 in need.settings["ratios"]
    assert cal.calibration_need("kvtc", "auto", 12.0).directory_name() == "kvtc-ratios=4_8_12_16_32_64"


def test_every_method_registers_on_import_kvpack_alone_from_one_explicit_list():
    code = ("import kvpack; from kvpack.registry import METHODS; from kvpack.methods.catalog import KVPACK_METHODS; "
            "print(','.join(sorted(METHODS))); print(','.join(sorted(n for n, _ in KVPACK_METHODS)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1]  # the registry after `import kvpack` is the catalog's list, nothing more or less
    assert set(out[0].split(",")) == set(available_methods())
    assert {"hf_quantized", "kvtc_resident", "kvtc", "kivi", "snapkv", "streaming", "h2o"} <= set(out[0].split(","))
    # no module of kvpack registers a method by being imported
    decorated = [p.relative_to(ROOT) for p in (ROOT / "kvpack").rglob("*.py")
                 if re.search(r"(?m)^\s*@register_method\(", p.read_text())]
    assert not decorated


def test_files_are_named_for_the_methods_they_hold():
    from kvpack.methods.catalog import KVPACK_METHODS

    for name, cls in KVPACK_METHODS:
        module = cls.__module__.split(".")
        assert name in module or name.removesuffix("_plus") in module or \
            (name, module[-1]) in {("hf_quantized", "quantized"), ("kvtc", "codec"), ("kvtc_resident", "resident")}, \
            (name, cls.__module__)


# -- calibrations made for the user -------------------------------------------------------------


def _small_profile(real):
    """profile_layers on short chunks of random ids (a tiny model has no tokenizer; the real code path)."""

    def run(model, tokenizer, progress=True, **_):
        g = torch.Generator().manual_seed(0)
        chunks = [torch.randint(0, 128, (520,), generator=g).tolist() for _ in range(2)]
        return real(model, None, budgets=(0.5, 0.9), chunks=2, chunk_tokens=512, continuation=8,
                    token_chunks=chunks, progress=False)

    return run


def test_auto_layer_profile_is_made_once_cached_by_fingerprint_and_refused_when_tampered(tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "cache_dir", lambda: tmp_path / "cache")  # (the native kernels keep the suite's)
    made = []
    real = _small_profile(cal.profile_layers)
    monkeypatch.setattr(cal, "profile_layers", lambda *a, **k: made.append(1) or real(*a, **k))
    model = tiny_llama(layers=2)
    method = get_method("pca_quant-layers", budget=0.4).for_model(model, tokenizer=object(), progress=False)
    directory = Path(method.config.calibration)
    assert directory.parent.name == kvpack.hf.fingerprint.model_fingerprint(model)["hash"]
    assert directory.is_relative_to(tmp_path / "cache") and (directory / "layer_profile.json").is_file()
    assert not [p for p in directory.parent.iterdir() if ".tmp-" in p.name]  # the staging directory is gone
    again = get_method("pca_quant-salient", budget=0.2).for_model(model, tokenizer=object(), progress=False)
    assert again.config.calibration == str(directory) and made == [1]  # made once, read after
    assert again.preset == "pca_quant-salient"
    # the cache the preset builds holds what its budget allows
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), kvpack.attach(model, "pca_quant-layers", budget=0.6, tokenizer=object(),
                                        progress=False) as cache:
        model(ids, use_cache=True, **kvpack.hf.cache.cache_kwargs(model, cache))
    assert cache.method_label == "pca_quant-layers" and cache.kv_bytes() <= 0.6 * cache.dense_kv_bytes()
    # another model's profile in this model's place, and a truncated file: one line naming the problem
    other = tiny_llama(layers=2, seed=5)
    other_dir = Path(get_method("pca_quant-layers", budget=0.4).for_model(other, object(), False).config.calibration)
    (directory / "layer_profile.json").write_text((other_dir / "layer_profile.json").read_text())
    with pytest.raises(ValueError, match="the layer profile was made for another model"):
        with kvpack.attach(model, "pca_quant-layers", budget=0.6, progress=False):
            pass
    (directory / "layer_profile.json").write_text('{"method": "pca_q')
    with pytest.raises(ValueError, match="is not a layer profile"):
        with kvpack.attach(model, "pca_quant-layers", budget=0.6, progress=False):
            pass


def test_a_cache_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(cal, "cache_dir", lambda: blocker / "cache")
    with pytest.raises(ValueError, match=r"cannot write this model's calibration under .*a-file.*KVPACK_CACHE_DIR"):
        get_method("pca_quant-layers", budget=0.3).for_model(tiny_llama(), tokenizer=object(), progress=False)


def test_making_a_calibration_without_a_tokenizer_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "cache_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match="needs its tokenizer"):
        get_method("kvtc_resident-8x").for_model(tiny_llama(), progress=False)


# -- the recommended cache ----------------------------------------------------------------------


def test_recommend_follows_the_frontier_ranking_for_each_measured_model():
    choices = load_choices()
    for model, data in choices["models"].items():
        fp = {"hash": data["fingerprint"]}
        for entry in data["settings"]["query-agnostic"]:
            best = entry["ranked"][0]
            rec = recommend(fingerprint=fp, budget=entry["budget"])
            assert (rec.method, rec.model, rec.measured_budget) == (best["method"], model, entry["budget"])
            assert rec.kl == best["kl"] and best["method"] in rec.reason
            assert (rec.budget is None) == (best["budget"] is None)
            get_method(rec.method, **rec.method_config())  # a name every entry point accepts
    # between measured budgets: the largest measured one below; it runs at the budget asked for
    fp = {"hash": choices["models"]["smollm2"]["fingerprint"]}
    rec = recommend(fingerprint=fp, budget=0.4)
    assert rec.measured_budget == 0.28 and rec.budget in (0.4, None)
    with pytest.raises(ValueError, match="no method is measured at or below a budget of 0.01"):
        recommend(fingerprint=fp, budget=0.01)
    with pytest.raises(ValueError, match=r"budget must be in \(0, 1\]"):
        recommend(fingerprint=fp, budget=1.5)


def test_recommend_for_an_unmeasured_model_is_closest_to_every_measured_models_best():
    rec = recommend(fingerprint={"hash": "unmeasured"}, budget=0.28)
    choices = load_choices()
    firsts = set()
    for data in choices["models"].values():
        entry = next(e for e in data["settings"]["query-agnostic"] if e["budget"] == 0.28)
        firsts.add(entry["ranked"][0]["method"])
    assert rec.model is None and rec.method in firsts and "has not measured" in rec.reason
    # a synthetic ranking where each model's first is the other's last: the closer one across both wins
    ranking = {"format": "kvpack-frontier-choices", "models": {
        "a": {"fingerprint": "A", "settings": {"query-agnostic": [{"budget": 0.28, "ranked": [
            {"method": "x", "budget": 0.28, "kl": 1.0, "score": 0.5, "n": 48},
            {"method": "y", "budget": 0.28, "kl": 1.1, "score": 0.5, "n": 48}]}]}},
        "b": {"fingerprint": "B", "settings": {"query-agnostic": [{"budget": 0.28, "ranked": [
            {"method": "y", "budget": 0.28, "kl": 1.0, "score": 0.5, "n": 48},
            {"method": "x", "budget": 0.28, "kl": 3.0, "score": 0.5, "n": 48}]}]}}}}
    assert recommend(fingerprint={"hash": "C"}, budget=0.3, choices=ranking).method == "y"
    assert recommend(fingerprint={"hash": "A"}, budget=0.3, choices=ranking).method == "x"


def test_auto_takes_only_a_budget():
    with pytest.raises(ValueError, match="method='auto' picks the method, so it takes only a budget"):
        resolve_auto(None, "auto", {"budget": 0.28, "page_size": 64})
    name, config, rec = resolve_auto(None, "puzzle", {"budget": 0.3})
    assert (name, config, rec) == ("puzzle", {"budget": 0.3}, None)


def test_packaged_calibrations_are_the_frontiers_own():
    for model_dir in sorted((RESULTS / "frontier").iterdir()):
        profile = model_dir / "pca_quant-layer-profile" / "layer_profile.json"
        fingerprint = json.loads(profile.read_text())["fingerprint"]
        shipped = cal.packaged_calibration(cal.CalibrationNeed("layer_profile", {}), fingerprint)
        assert shipped is not None and (shipped / "layer_profile.json").read_text() == profile.read_text()
        assert load_choices()["models"][model_dir.name]["fingerprint"] == fingerprint["hash"]


@pytest.mark.model
def test_attach_with_no_method_uses_the_frontiers_choice_for_smollm2_and_says_so(smollm2, capsys):
    from kvpack.hf.cache import cache_kwargs
    from kvpack.prompts import needle_prompt

    model, tok = smollm2
    prompt, _ = needle_prompt(tok, n_tokens=1024, depth=0.5, seed=3)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad(), kvpack.attach(model, budget=0.28) as cache:  # the shipped layer profile: nothing to make
        model(ids, use_cache=True, **cache_kwargs(model, cache))
    rec = recommend(model, 0.28)
    assert cache.recommendation == rec and cache.method_label == rec.method and rec.model == "smollm2"
    assert f"[kvpack] method auto: {rec.method} at 0.28" in capsys.readouterr().err
    assert cache.kv_bytes() <= 0.28 * cache.dense_kv_bytes()
    assert rec.method in available_presets() + available_methods()


@pytest.mark.model
def test_generate_with_no_method_runs_the_default_and_returns_its_reason(smollm2, tmp_path, capsys):
    from kvpack.cli import main
    from kvpack.prompts import needle_prompt

    prompt, _ = needle_prompt(smollm2[1], n_tokens=1024, depth=0.3, seed=5)
    (tmp_path / "p.txt").write_text(prompt)
    assert main(["generate", "--budget", "0.28", "--prompt-file", str(tmp_path / "p.txt"), "--json",
                 "--max-new-tokens", "3", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    rec = recommend(smollm2[0], 0.28)
    assert out["recommendation"]["method"] == out["method"] == rec.method
    assert out["recommendation"]["model"] == "smollm2"
    assert out["kv_bytes"] <= 0.28 * out["dense_kv_bytes"] and out["config"]["calibration"] != AUTO_CALIBRATION
    # a method named: no recommendation, the method's own label
    assert main(["generate", "--method", "pca_quant-layers", "--budget", "0.28", "--prompt-file",
                 str(tmp_path / "p.txt"), "--json", "--max-new-tokens", "2", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "pca_quant-layers" and "recommendation" not in out


@pytest.mark.model
def test_eval_auto_runs_the_defaults_pick_at_each_budget_named_as_it(smollm2):
    specs = method_specs(["full", "auto", "pca_quant-salient"], [0.28, 0.15], model=smollm2[0])
    picks = {b: recommend(smollm2[0], b).method for b in (0.28, 0.15)}
    named = [(s.name or s.method, s.budget) for s in specs]
    assert ("full", None) in named and (picks[0.28], 0.28) in named
    assert (picks[0.15], 0.15 if method_takes_budget(picks[0.15]) else None) in named
    # auto's pick at 0.28 and the same preset named by hand are one spec (the rows are that method's rows)
    assert len([n for n in named if n == ("pca_quant-salient", 0.28)]) == 1
    with pytest.raises(ValueError, match="method 'auto' needs the model"):
        method_specs(["auto"], [0.28])
