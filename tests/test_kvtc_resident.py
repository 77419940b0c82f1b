"""``kvtc_resident``: kvtc's codes held resident. Its coded tokens are kvtc's own (the storage codec's
decompression of the same prefill, equal), coding continues while decoding in runs of ``block`` tokens,
the shared codes are counted once, a copy shares the calibration but not the codes' bookkeeping, and bad
configurations are refused by name. (The method matrix holds it to the invariants of every resident method:
attention equals attention over ``reconstruct``, the harness's cache equals the live one, padded batches.)"""

from __future__ import annotations

import pytest
import torch

from kvpack.hf.attach import attach
from kvpack.hf.cache import cache_kwargs
from kvpack.hf.dense import prefill
from kvpack.hf.prefill import exact_prefill
from kvpack.methods import get_method
from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate
from kvpack.storage.kvtc.coder import compress_cache, decompress_cache

from .helpers import TINY_KVTC_SETTINGS, tiny_kvtc, tiny_kvtc_chunks, tiny_qwen2

SINKS, WINDOW, BLOCK = TINY_KVTC_SETTINGS["sinks"], TINY_KVTC_SETTINGS["window"], 8


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model, calib = tiny_kvtc()
    directory = tmp_path_factory.mktemp("kvtc-resident-calibration")
    calib.save(directory)
    return model, calib, str(directory)


def _calibrated_again(calibrated, tmp_path_factory, name: str, **settings):
    """The tiny model of ``calibrated`` calibrated again with other ``CalibrationSettings``, saved."""
    model = calibrated[0]
    calib = calibrate(model, None, CalibrationSettings(ratios=(4.0, 8.0), **settings, **TINY_KVTC_SETTINGS),
                      chunks=tiny_kvtc_chunks(), progress=False)
    directory = tmp_path_factory.mktemp(name)
    calib.save(directory)
    return model, calib, str(directory)


@pytest.fixture(scope="module")
def calibrated_per_layer(calibrated, tmp_path_factory):
    """The same tiny model calibrated with one basis per layer (``layer_group=1``)."""
    return _calibrated_again(calibrated, tmp_path_factory, "kvtc-resident-calibration-per-layer", layer_group=1)


@pytest.fixture(scope="module")
def calibrated_keys_per_layer(calibrated, tmp_path_factory):
    """The same tiny model calibrated with one key basis per layer and kvtc's cross-layer value basis."""
    return _calibrated_again(calibrated, tmp_path_factory, "kvtc-resident-calibration-keys-per-layer",
                             key_layer_group=1)


CALIBRATIONS = {"cross-layer": "calibrated", "per-layer": "calibrated_per_layer",
                "keys-per-layer": "calibrated_keys_per_layer"}


def test_a_keys_per_layer_calibration_blocks_the_keys_only(calibrated_keys_per_layer, calibrated):
    _, calib, _ = calibrated_keys_per_layer
    assert calib.layer_group("keys") == 1 and calib.layer_group("values") is None
    assert set(calib.component_blocks("keys", calib.key_basis.shape[1]).tolist()) == {0, 1}
    width = calib.kv_heads * calib.head_dim
    r = calib.key_basis.shape[1]
    blocks = calib.component_blocks("keys", r)
    assert float(calib.key_basis[width:, blocks == 0].abs().max()) == 0.0
    cross = calibrated[1]  # the values' basis is the cross-layer one (same corpus and settings; each calibration
    common = min(calib.value_basis.shape[1], cross.value_basis.shape[1])  # keeps the components its ratios code)
    torch.testing.assert_close(calib.value_basis[:, :common].abs(), cross.value_basis[:, :common].abs(), atol=1e-4,
                               rtol=0)


def test_a_per_layer_calibration_has_a_block_diagonal_orthonormal_basis(calibrated_per_layer):
    _, calib, _ = calibrated_per_layer
    width = calib.kv_heads * calib.head_dim
    for kind, basis in (("keys", calib.key_basis), ("values", calib.value_basis)):
        r = basis.shape[1]
        torch.testing.assert_close(basis.T @ basis, torch.eye(r), atol=1e-5, rtol=0)
        blocks = calib.component_blocks(kind, r)
        assert set(blocks.tolist()) == {0, 1}
        for j in range(2):  # a component of layer j's block is zero on the other layer's features
            other = basis[(1 - j) * width:(2 - j) * width, blocks == j]
            assert float(other.abs().max()) == 0.0
    assert calib.layer_group("keys") == calib.layer_group("values") == 1 and "layer_group" in calib.settings


def _ids(n: int, seed: int = 3) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(directory: str, **over) -> dict:
    return {"calibration": directory, "ratio": 4.0, "block": BLOCK, "storage_dtype": "float32",
            "decode_precision": "float32", "encode_precision": "float32", **over}


@pytest.mark.parametrize("which", list(CALIBRATIONS))
@torch.no_grad()
def test_the_coded_tokens_are_kvtcs_own(which, request):
    model, calib, directory = request.getfixturevalue(CALIBRATIONS[which])
    n = SINKS + WINDOW + 12 * BLOCK  # kvtc codes [sinks, n - window): a multiple of the block, so the same tokens
    ids = _ids(n)
    prepared = get_method("kvtc_resident", **_config(directory)).from_prefill(model, exact_prefill(model, ids))
    blob = compress_cache(prefill(model, ids), calib, 4.0, ids, model=model)
    dense, _ = decompress_cache(blob, calib, model, precision="float32")
    stores = [layer.rows[0] for layer in prepared.cache.kvpack_layers]
    assert stores[-1].group.n_coded == n - SINKS - WINDOW
    for store in stores:
        k_hat, v_hat = store.reconstruct()
        want = dense.layers[store.layout.layer_idx]
        torch.testing.assert_close(k_hat, want.keys[0].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_hat, want.values[0].float(), rtol=1e-5, atol=1e-5)
    # and they are lossy: the coded tokens differ from the exact ones, the dense ones do not
    exact = prefill(model, ids).layers[stores[0].layout.layer_idx]
    coded = slice(SINKS, n - WINDOW)
    assert not torch.allclose(stores[0].reconstruct()[1][:, coded], exact.values[0, :, coded].float(), atol=1e-3)
    torch.testing.assert_close(stores[0].reconstruct()[1][:, n - WINDOW:], exact.values[0, :, n - WINDOW:].float())


@torch.no_grad()
def test_decoding_codes_runs_of_block_tokens_and_counts_the_codes_once(calibrated):
    model, _, directory = calibrated
    ids = torch.tensor([_ids(61)])
    with attach(model, "kvtc_resident", **_config(directory)) as cache:
        logits = model(ids, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
        stores = [layer.rows[0] for layer in cache.kvpack_layers]
        group = stores[0].group
        assert all(s.group is group for s in stores)
        runs_after_prefill = list(group.runs)
        for _ in range(3 * BLOCK + 3):
            logits = model(logits.argmax(-1, keepdim=True), use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
            for s in stores:
                assert WINDOW <= s.tail_k.shape[1] < WINDOW + BLOCK
                assert s.seq_len == SINKS + group.n_coded + s.tail_k.shape[1]
        assert group.runs[:len(runs_after_prefill)] == runs_after_prefill
        assert group.runs[len(runs_after_prefill):] == [BLOCK] * 3
        assert group._coefficients is None  # the forward pass's dequantized coefficients are let go
        codes = sum(t.numel() * t.element_size() for t in group.tensors().values())
        dense = sum(t.numel() * t.element_size() for s in stores for name, t in s.tensors().items()
                    if name in ("sink_k", "sink_v", "tail_k", "tail_v"))
        assert codes > 0 and cache.kv_bytes() == codes + dense  # the shared codes once, on the last layer's store
        assert set(stores[-1].tensors()) > {"sink_k", "tail_k"} and set(stores[0].tensors()) == {
            "sink_k", "sink_v", "tail_k", "tail_v"}


def _group(model, directory: str, ids: list[int], **over):
    prepared = get_method("kvtc_resident", **_config(directory, **over)).from_prefill(model, exact_prefill(model, ids))
    return prepared.cache.kvpack_layers[0].rows[0].group


def _attended(group, layer_idx: int, qg: torch.Tensor, scaling: float) -> torch.Tensor:
    state = group.attend(layer_idx, qg, scaling, "torch")
    out = state.o / state.l.unsqueeze(-1)
    group.release()
    return out.double()


@pytest.mark.parametrize("which", list(CALIBRATIONS))
@torch.no_grad()
def test_values_contracted_on_the_coefficients_equal_the_rebuilt_values(which, request, monkeypatch):
    """``(P D) Bᵀ + (P 1) μ`` is ``P V`` for the rebuilt ``V``: equal in fp32 GEMMs; in bf16 each path rounds
    its own products, and the coefficients' are no worse than the rebuild's. ``auto`` takes the coefficients
    for decode-sized query rows only. With a basis per layer, each layer's own block of components."""
    model, _, directory = request.getfixturevalue(CALIBRATIONS[which])
    ids = _ids(SINKS + WINDOW + 12 * BLOCK)
    exact = _group(model, directory, ids)  # fp32 GEMMs (_config)
    paths = {(precision, path): _group(model, directory, ids, decode_precision=precision, value_path=path)
             for precision in ("float32", "bfloat16") for path in ("coefficients", "rebuild")}
    heads, d = exact.calibration.kv_heads, exact.calibration.head_dim
    g = torch.Generator().manual_seed(0)
    for layer_idx in exact.layer_order:
        k, v = exact.layer(layer_idx)
        exact.release()
        qg = torch.randn(heads, 5, d, generator=g) * 2
        p = torch.softmax(qg.double() @ k.double().transpose(1, 2) * d ** -0.5, dim=-1)
        ref = p @ v.double()
        err = {}
        for (precision, path), group in paths.items():
            err[precision, path] = float((_attended(group, layer_idx, qg, d ** -0.5) - ref).abs().max())
        scale = float(ref.abs().max())
        assert err["float32", "coefficients"] < 1e-5 * scale and err["float32", "rebuild"] < 1e-5 * scale, err
        assert 0 < err["bfloat16", "coefficients"] < 2e-2 * scale, err  # bf16 rounds: the check is not vacuous
        assert err["bfloat16", "coefficients"] <= 1.5 * err["bfloat16", "rebuild"], err
    calls = []
    original = type(exact).contract_values
    monkeypatch.setattr(type(exact), "contract_values", lambda self, *a: calls.append(1) or original(self, *a))
    layer_idx = exact.layer_order[0]
    _attended(exact, layer_idx, torch.randn(heads, d - 1, d, generator=g), d ** -0.5)
    assert len(calls) == 1
    _attended(exact, layer_idx, torch.randn(heads, d, d, generator=g), d ** -0.5)  # a prefill chunk: rebuilt
    assert len(calls) == 1


@torch.no_grad()
def test_coding_in_bf16_leaves_the_coding_error_as_it_is(calibrated):
    """bf16 projection GEMMs (``encode_precision``) change some codes, but not the error of the coded cache."""
    model, _, directory = calibrated
    ids = _ids(SINKS + WINDOW + 12 * BLOCK)
    exact = prefill(model, ids)
    errors, codes = {}, {}
    for precision in ("float32", "bfloat16"):
        group = _group(model, directory, ids, encode_precision=precision)
        codes[precision] = group.sections["values"][0]["values_codes"]
        error = total = 0.0
        for layer_idx in group.layer_order:
            k, v = group.layer(layer_idx)
            coded = slice(SINKS, SINKS + group.n_coded)
            for rebuilt, want in ((k, exact.layers[layer_idx].keys[0, :, coded]),
                                  (v, exact.layers[layer_idx].values[0, :, coded])):
                error += float(((rebuilt.double() - want.double()) ** 2).sum())
                total += float((want.double() ** 2).sum())
        group.release()
        errors[precision] = error / total
    assert not torch.equal(codes["float32"], codes["bfloat16"])  # the bf16 GEMM did run
    assert 0 < errors["float32"] and abs(errors["bfloat16"] / errors["float32"] - 1) < 0.05, errors


@torch.no_grad()
def test_a_copy_shares_the_calibration_not_the_runs(calibrated):
    model, _, directory = calibrated
    prepared = get_method("kvtc_resident", **_config(directory)).from_prefill(model, exact_prefill(model, _ids(70)))
    twin = prepared.copy()
    a, b = prepared.cache.kvpack_layers[0].rows[0].group, twin.cache.kvpack_layers[0].rows[0].group
    assert a is not b and a.calibration is b.calibration  # the basis is the model's: never copied
    assert all(s.group is b for layer in twin.cache.kvpack_layers for s in layer.rows)
    a.runs.append(0)
    assert b.runs != a.runs


def test_bad_configurations_are_refused_by_name(calibrated, tmp_path):
    model, _, directory = calibrated
    with pytest.raises(ValueError, match="needs a kvtc calibration"):
        with attach(model, "kvtc_resident", ratio=4.0):
            pass
    with pytest.raises(ValueError, match="no bit allocation for ratio 3"):
        with attach(model, "kvtc_resident", calibration=directory, ratio=3.0):
            pass
    with pytest.raises(ValueError, match="not a budget"):
        get_method("kvtc_resident", calibration=directory, budget=0.25)
    with pytest.raises(ValueError, match="block must be a multiple of 8"):
        get_method("kvtc_resident", calibration=directory, block=12)
    with pytest.raises(ValueError, match="another model"):
        with attach(tiny_qwen2(), "kvtc_resident", calibration=directory, ratio=4.0):
            pass
    with pytest.raises(FileNotFoundError, match="not a kvtc calibration directory"):
        with attach(model, "kvtc_resident", calibration=str(tmp_path), ratio=4.0):
            pass
