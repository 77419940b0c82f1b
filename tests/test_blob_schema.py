"""Issue 17, item 2: a blob whose checksum is valid but whose header kvpack did not write is refused
with BlobError naming the problem, never a traceback from torch or a cache of garbage."""

from __future__ import annotations

import json

import pytest
import torch

from kvpack.storage.kvtc.coder import compress_cache, decompress_cache
from kvpack.storage.kvtc.session import prefill
from kvpack.store.format import Blob, BlobError
from kvpack.store.prefix import PrefixStore
from kvpack.store.schema import MAX_DEPTH, ForeignBlobError

from .helpers import join_blob, split_blob, tiny_kvtc, token_ids


@pytest.fixture(scope="module")
def kvtc_blob():
    model, calib = tiny_kvtc(ratios=(4,))
    ids = token_ids(40)
    blob = compress_cache(prefill(model, ids), calib, 4, ids, model=model)
    return model, calib, ids, blob


def _section(header: dict, name: str) -> dict:
    return next(s for s in header["sections"] if s["name"] == name)


def _edited(blob: bytes, edit) -> bytes:
    header, data = split_blob(blob)
    edit(header)
    return join_blob(header, data, fix_offsets=isinstance(header["sections"], list))


HOSTILE_HEADERS = {
    # what each edit did before the schema (issue 17's list) -> the field the error now names
    "missing field": (lambda h: h.pop("sinks"), "lacks field 'sinks'"),  # KeyError
    "mistyped field": (lambda h: h.update(tokens="40"), "'tokens' must be an integer"),
    "bool for int": (lambda h: h.update(coded_tokens=True), "'coded_tokens' must be an integer"),
    "negative shape": (lambda h: _section(h, "sink_keys").update(shape=[-2, -3]), "'shape' must hold integers"),
    "huge shape": (lambda h: _section(h, "sink_keys").update(shape=[2 ** 64]), "'shape' must hold integers"),
    "model not an object": (lambda h: h.update(model="llama"), "'model' must be an object"),  # AttributeError
    "cache dtype int8": (lambda h: h.update(cache_dtype="int8"), "'cache_dtype' must be one of"),  # garbage keys
    "cache dtype bool": (lambda h: h.update(cache_dtype="bool"), "'cache_dtype' must be one of"),
    "cache dtype complex64": (lambda h: h.update(cache_dtype="complex64"), "'cache_dtype' must be one of"),
    "cache dtype of the wrong sections": (lambda h: h.update(cache_dtype="bfloat16"),
                                          "is float32 .* expected bfloat16"),
    "layers reordered": (lambda h: h.update(layers=h["layers"][::-1]), "differ from its calibration's"),
    "heads and head dim swapped": (lambda h: h.update(kv_heads=h["head_dim"], head_dim=h["kv_heads"]),
                                   "differ from its calibration's"),
    "sink tensor reshaped": (lambda h: _section(h, "sink_keys").update(shape=_section(h, "sink_keys")["shape"][::-1]),
                             "section 'sink_keys' is float32"),
    "token counts disagree": (lambda h: h.update(window=h["window"] + 1), "!= 40 tokens"),
    "another ratio": (lambda h: h.update(ratio="8"), "ratio 8 is not one of its calibration's"),
    "allocation edited": (lambda h: h["allocation"]["keys"].update(error=0.0), "bit allocation differs"),
    "dense bytes inflated": (lambda h: h.update(dense_bf16_bytes=h["dense_bf16_bytes"] * 2), "dense_bf16_bytes"),
    "unknown field": (lambda h: h.update(extra=1), "fields this kvpack does not know: extra"),
    "unknown backend": (lambda h: h.update(backend="lz4"), "'backend' must be one of"),
    "section listed twice": (lambda h: h["sections"].append(dict(h["sections"][0])), "appears twice"),
    "section name with a path": (lambda h: h["sections"][0].update(name="../x"), "not of the expected form"),
    "sections not a list": (lambda h: h.update(sections={"a": 1}), "'sections' must be a list"),
    "another codec": (lambda h: h.update(codec="puzzle"), "codec 'puzzle'"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_header_is_refused_naming_the_field(kvtc_blob, case):
    model, calib, _, blob = kvtc_blob
    edit, message = HOSTILE_HEADERS[case]
    hostile = _edited(blob, edit)
    with pytest.raises(BlobError, match=message):
        decompress_cache(hostile, calib, model)


def test_deeply_nested_and_oversized_headers_are_refused(kvtc_blob):
    model, calib, _, blob = kvtc_blob
    header, data = split_blob(blob)
    deep = json.dumps(header, sort_keys=True)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(BlobError, match=f"nests deeper than {MAX_DEPTH}"):  # before: RecursionError
        decompress_cache(join_blob(deep.encode(), data), calib, model)
    shallow = json.dumps(header, sort_keys=True)[:-1] + ', "x": ' + "[" * 9 + "]" * 9 + "}"
    with pytest.raises(BlobError, match=f"nests deeper than {MAX_DEPTH}"):
        Blob(join_blob(shallow.encode(), data))
    for raw in (b"[1, 2]", b"\xff\xfe", b'{"a": 1' + b"0" * 5000 + b"}"):  # not an object / not UTF-8 / 5000 digits
        with pytest.raises(BlobError, match="blob header"):
            Blob(join_blob(raw, data))


def test_payload_no_section_accounts_for_is_refused(kvtc_blob):
    _, _, _, blob = kvtc_blob
    header, data = split_blob(blob)
    data[header["sections"][-1]["name"]] += b"\x00" * 7
    padded = join_blob(header, data)
    header["sections"][-1]["size"] -= 7  # the table no longer covers the last 7 bytes
    with pytest.raises(BlobError, match="7 bytes no section accounts for"):
        Blob(join_blob(header, data, fix_offsets=False))
    Blob(padded)  # the same bytes, described by the table, parse (the section itself is checked on decode)


def test_mismatched_model_and_calibration_are_foreign(kvtc_blob):
    model, calib, _, blob = kvtc_blob
    relabelled = _edited(blob, lambda h: h["model"].update(hash="0" * 32))
    with pytest.raises(ForeignBlobError, match="another model"):
        decompress_cache(relabelled, calib, model)
    other = _edited(blob, lambda h: h.update(calibration_id="f" * 24))
    with pytest.raises(ForeignBlobError, match="calibration"):
        decompress_cache(other, calib, model)


def test_store_refuses_a_hostile_header_and_keeps_what_it_holds(kvtc_blob, tmp_path):
    model, calib, ids, blob = kvtc_blob
    store = PrefixStore(tmp_path / "store")
    store.put(blob, ids)
    for edit in (lambda h: h.update(model="llama"), lambda h: h.update(tokens="40"),
                 lambda h: h["model"].update(hash="../../etc")):
        with pytest.raises(BlobError):
            store.put(_edited(blob, edit), ids)
    fingerprint = Blob(blob).meta["model"]["hash"]
    assert store.longest_prefix(fingerprint, calib.calibration_id, ids + [1]) == (len(ids), blob)


def test_a_float32_cache_restores_exactly(kvtc_blob):
    """The schema refuses nothing kvpack writes: the untouched blob still decodes to the same cache."""
    model, calib, ids, blob = kvtc_blob
    restored, got_ids = decompress_cache(blob, calib, model)
    assert got_ids == ids
    dense = prefill(model, ids)
    for i, layer in enumerate(restored.layers):
        assert layer.keys.dtype == torch.float32
        sink = calib.sinks
        torch.testing.assert_close(layer.keys[:, :, :sink], dense.layers[i].keys[:, :, :sink], atol=0, rtol=0)


def test_blob_longer_than_the_models_context_is_refused_on_restore():
    """Issue 17, item 7: a blob holding more tokens than the model's context (made here by running
    the model past its context directly, which kvpack's own prefill refuses) does not restore."""
    from transformers import DynamicCache

    model, calib = tiny_kvtc(ratios=(4,))  # max_position_embeddings = 1024
    ids = token_ids(1030)
    with pytest.raises(ValueError, match="exceed the model's context"):
        prefill(model, ids)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    blob = compress_cache(cache, calib, 4, ids, model=model)
    with pytest.raises(ValueError, match="blob holds 1030 tokens, more than the model's context of 1024"):
        decompress_cache(blob, calib, model)
