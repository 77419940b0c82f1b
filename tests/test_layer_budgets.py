"""Per-layer budgets from a layer profile: the allocation against brute force, the profile's file and its
refusals, and pca_quant on a tiny model with a profile measured on it (bytes within the budget; another
model refused)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from kvpack.hf.fingerprint import model_fingerprint
from kvpack.methods import get_method
from kvpack.methods.layer_profile import profile_layers
from kvpack.resident.pca_quant.layer_budgets import PROFILE_FILE, LayerBudgets, LayerProfile

from .helpers import tiny_llama, token_ids

FINGERPRINT = {"architecture": "Test", "layers": 3, "hash": "a" * 32}


class _IdsTokenizer:
    """What generation needs of a tokenizer on a random model: a pad id and a decode."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _profile(kl, budgets=(0.1, 0.2, 0.3, 0.5), layers=None):
    return LayerProfile(method="pca_quant", fingerprint=FINGERPRINT, layers=layers or list(range(len(kl))),
                        budgets=list(budgets), kl=kl)


def _interp(profile, i, b):
    return float(profile._interpolated(i, torch.tensor([b], dtype=torch.float64))[0])


def test_the_allocation_is_the_least_summed_kl_within_the_budget():
    g = torch.Generator().manual_seed(0)
    kl = (torch.rand(3, 4, generator=g) * 0.5 + 0.5).cumprod(1).flip(1).mul(torch.tensor([[1.0], [8.0], [0.2]]))
    profile = _profile(kl.tolist())  # decreasing in the budget; layer 1 the most sensitive, layer 2 the least
    step = 0.05
    for budget in (0.15, 0.2, 0.3):
        shares = profile.allocate(budget, step=step)
        assert sum(shares.values()) / 3 <= budget + 1e-12
        got = sum(_interp(profile, i, shares[i]) for i in range(3))
        grid = [0.1 + step * k for k in range(9)]  # 0.1 .. 0.5
        brute = min(sum(_interp(profile, i, b) for i, b in enumerate(combo))
                    for combo in itertools.product(grid, repeat=3) if sum(combo) / 3 <= budget + 1e-12)
        assert got == pytest.approx(brute, rel=1e-9)
        assert shares[1] >= shares[0] >= shares[2]  # the sensitive layer gets the most


def test_no_layer_gets_less_than_the_floor_and_a_floor_above_the_budget_is_uniform():
    kl = [[1.0, 0.1, 0.01, 0.001], [0.01, 0.005, 0.002, 0.001], [0.02, 0.01, 0.004, 0.001]]
    profile = _profile(kl)  # layer 0 far more sensitive: unfloored, the others drop to the grid's lowest
    assert min(profile.allocate(0.2).values()) == pytest.approx(0.1)
    shares = profile.allocate(0.2, floor=0.16)
    assert min(shares.values()) >= 0.16 - 1e-12 and sum(shares.values()) / 3 <= 0.2 + 1e-12
    assert shares[0] > 0.2
    assert profile.allocate(0.15, floor=0.16) == {0: 0.15, 1: 0.15, 2: 0.15}
    group = LayerBudgets(profile, 0.2, [0, 1, 2])
    first = group.budget_for(1, floor=lambda: 0.16)
    later = group.budget_for(1, floor=lambda: pytest.fail("the floor is asked once, by the first layer to code"))
    assert later == first == shares[1]  # allocated once, at the first coding


def test_the_kl_is_interpolated_log_linearly_and_a_budget_off_the_grid_is_uniform():
    profile = _profile([[0.1, 0.01, 0.001, 1e-5]])
    assert _interp(profile, 0, 0.15) == pytest.approx(math.sqrt(0.1 * 0.01))
    assert _interp(profile, 0, 0.2) == pytest.approx(0.01)
    assert profile.allocate(0.05) == {0: 0.05} and profile.allocate(0.7) == {0: 0.7}


def test_a_profile_round_trips_and_bad_files_are_refused_by_name(tmp_path):
    profile = _profile([[0.2, 0.1, 0.05, 0.01], [0.3, 0.2, 0.1, 0.02]], layers=[0, 2])
    profile.save(tmp_path)
    assert LayerProfile.load(tmp_path) == profile
    with pytest.raises(ValueError, match="kvpack calibrate --method pca_quant"):
        LayerProfile.load(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="not \\[1\\]"):
        profile.allocate(0.2, layers=[0, 1])
    path = tmp_path / PROFILE_FILE
    data = json.loads(path.read_text())
    for broken, message in [
        (path.read_text()[:50], "not JSON"),
        (json.dumps({**data, "version": 7}), "version-1"),
        (json.dumps({**data, "kl": data["kl"][:1]}), "kl must be"),
        (json.dumps({**data, "kl": [[0.2, float("nan"), 0.05, 0.01], data["kl"][1]]}), "finite"),
        (json.dumps({**data, "budgets": [0.3, 0.2, 0.4, 0.5]}), "increasing"),
        (json.dumps({**data, "extra": 1}), "not a layer profile"),
    ]:
        path.write_text(broken)
        with pytest.raises(ValueError, match=message):
            LayerProfile.load(tmp_path)
    with pytest.raises(ValueError, match="another model"):
        profile.check_fingerprint({**FINGERPRINT, "hash": "b" * 32})


@pytest.mark.slow
def test_pca_quant_with_a_profile_of_its_model_keeps_the_budget_and_refuses_another_model(tmp_path):
    model = tiny_llama(layers=3)
    chunks = [token_ids(200, seed=s) for s in (1, 2)]
    profile = profile_layers(model, None, chunks=2, chunk_tokens=192, continuation=8, token_chunks=chunks,
                             budgets=(0.2, 0.4, 0.8), progress=False, block=16)
    assert profile.layers == [0, 1, 2] and profile.fingerprint == model_fingerprint(model)
    kl = torch.tensor(profile.kl)
    assert torch.isfinite(kl).all() and (kl >= 0).all() and (kl[:, 0] > 0).all()
    profile.save(tmp_path)
    ids = token_ids(120, seed=5)
    for budget in (0.35, 0.45, 0.6):  # at 120 tokens a layer needs about 0.28: the floor keeps the profile's 0.2 out
        method = get_method("pca_quant", budget=budget, block=16, calibration=str(tmp_path))
        result = method.generate(model, _IdsTokenizer(), ids, max_new_tokens=4)
        assert result.kv_bytes <= budget * result.dense_kv_bytes
    with pytest.raises(ValueError, match="another model"):
        get_method("pca_quant", budget=0.4, block=16, calibration=str(tmp_path)).generate(
            tiny_llama(layers=3, seed=1), _IdsTokenizer(), ids, max_new_tokens=2)
