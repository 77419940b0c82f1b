"""The kvtc serde inside LMCache 0.5.6: a chunk stored through LMCache's storage manager (L1 + the
native Redis L2 adapter with ``"serde": {"type": "kvtc"}``) in one process is fetched from a real Redis
server in a second process and decoded within kvtc's error at that ratio; corrupted or foreign chunks
are misses."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install -e '.[lmcache]'; .ci/run does)")

from kvpack.hf.dense import prefill  # noqa: E402
from kvpack.storage.kvtc.calibration import CalibrationSettings, calibrate  # noqa: E402
from kvpack.storage.kvtc.chunk import ChunkCodec  # noqa: E402
from kvpack.storage.kvtc.coder import compress_cache, decompress_cache  # noqa: E402

from .helpers import TINY_KVTC_SETTINGS, kv_chunk, tiny_kvtc_chunks, tiny_llama, token_ids  # noqa: E402

RATIO = 4
CHUNK = 256


def _manager(port: int, calibration: str):
    """An LMCache storage manager: 50 MB of L1, the native Redis L2 adapter with the kvtc serde."""
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    import kvpack.integrations.lmcache_serde  # noqa: F401 - registers "kvtc" in this process

    adapter = {"type": "resp", "host": "127.0.0.1", "port": port,
               "serde": {"type": "kvtc", "calibration": calibration, "ratio": RATIO}}
    return StorageManager(parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                                      "--l2-adapter", json.dumps(adapter)]))


def _keys(n: int, model_name: str = "tiny"):
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=bytes([i + 1]) * 16, model_name=model_name, kv_rank=0) for i in range(n)]


def _layout(shape):
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    return MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[torch.float32])


def _store(port: int, calibration: str, chunks: list, done) -> None:
    """Process A: write the chunks into LMCache; its store controller pushes them to Redis (serialized)."""
    import redis

    manager = _manager(port, calibration)
    keys = _keys(len(chunks))
    objects = manager.reserve_write(keys, _layout(tuple(chunks[0].shape)))
    for key, chunk in zip(keys, chunks):
        objects[key].tensor.copy_(torch.from_numpy(chunk))
    manager.finish_write(keys)
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 60
    while client.dbsize() < len(chunks) and time.monotonic() < deadline:
        time.sleep(0.05)
    manager.close()
    done.put(client.dbsize())


def _fetch(port: int, calibration: str, n: int, shape, out) -> None:
    """Process B: an empty LMCache (nothing in L1) prefetches the keys, one task each; L2 hits are read back."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    manager = _manager(port, calibration)
    results = []
    for key in _keys(n):
        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=[key], object_group_id=0,
                                                              layout_desc=_layout(shape))])
        handle = manager.submit_prefetch_task(spec)
        while (status := manager.query_prefetch_status(handle)) is None:
            time.sleep(0.02)
        if status.hit_cells[0].popcount() == 0:
            results.append(None)
            continue
        assert status.l2_hit_count == 1
        with manager.read_prefetched_results([key], status.l1_owners) as got:
            results.append(got[0].tensor.numpy().copy())  # numpy: pickled by value across processes
        manager.finish_read_prefetched([key])
    manager.close()
    out.put(results)


def _run(target, *args, timeout=180):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=timeout)
    proc.join(60)
    assert proc.exitcode == 0
    return result


# The serde refuses to start where vLLM would use its AMX kernels (their KV block layout is not the one
# its default vllm_cpu order describes); the tests that run it in LMCache need a CPU without AMX.
needs_no_amx = pytest.mark.skipif(torch.cpu._is_amx_tile_supported(),
                                  reason="this CPU has AMX: the kvtc serde refuses the vllm_cpu layout here")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=16, layers=2)
    calib = calibrate(model, None, CalibrationSettings(ratios=(RATIO,), key_rope="post", **TINY_KVTC_SETTINGS),
                      chunks=tiny_kvtc_chunks(), progress=False)
    directory = tmp_path_factory.mktemp("calibration")
    calib.save(directory)
    return model, calib, str(directory)


@pytest.fixture(scope="module")
def real_chunks(calibrated):
    """Two 256-token chunks of the tiny model's real keys and values, and kvtc's measured error on them."""
    model, calib, _ = calibrated
    chunks, errors = [], []
    for seed in (1, 2):
        ids = token_ids(CHUNK, seed=seed)
        cache = prefill(model, ids)
        chunks.append(kv_chunk(cache))
        blob = compress_cache(cache, calib, RATIO, ids, model=model, backend="none", sinks=0, window=0)
        restored, _ = decompress_cache(blob, calib, model)
        errors.append(float((kv_chunk(restored) - chunks[-1]).norm() / chunks[-1].norm()))
    return chunks, errors


@pytest.mark.slow
@needs_no_amx
def test_chunk_stored_in_one_process_is_fetched_from_redis_in_another(calibrated, real_chunks, redis_server,
                                                                      redis_url):
    _, calib, directory = calibrated
    chunks, errors = real_chunks
    assert _run(_store, redis_server.port, directory, [c.numpy() for c in chunks]) == len(chunks)
    client = redis_server.client()
    codec = ChunkCodec(calib, RATIO)
    sizes = [client.strlen(k) for k in client.keys("*")]
    dense_bf16 = chunks[0].numel() * 2
    assert all(s % 4096 == 0 and s <= dense_bf16 / RATIO + 4096 for s in sizes), (sizes, dense_bf16)
    fetched = _run(_fetch, redis_server.port, directory, len(chunks), tuple(chunks[0].shape))
    for chunk, got, measured in zip(chunks, fetched, errors):
        assert got is not None, "an L2 hit was expected"
        got = torch.from_numpy(got)
        torch.testing.assert_close(got, codec.decode(codec.encode(chunk)), rtol=0, atol=0)
        err = float((got - chunk).norm() / chunk.norm())
        assert err <= measured * (1 + 1e-6), (err, measured)  # kvtc's own error at this ratio, no worse


@pytest.mark.slow
@needs_no_amx
def test_corrupted_or_foreign_chunks_are_misses(calibrated, real_chunks, redis_server, redis_url, tmp_path):
    model, _, directory = calibrated
    chunks, _ = real_chunks
    assert _run(_store, redis_server.port, directory, [c.numpy() for c in chunks]) == len(chunks)
    client = redis_server.client()
    first, second = sorted(client.keys("*"))
    data = bytearray(client.get(first))
    data[300] ^= 0x01
    client.set(first, bytes(data))
    fetched = _run(_fetch, redis_server.port, directory, len(chunks), tuple(chunks[0].shape))
    assert fetched[0] is None and fetched[1] is not None  # the corrupted chunk is a miss, the other a hit
    other = calibrate(model, None, CalibrationSettings(ratios=(RATIO,), key_rope="post", seed=3,
                                                       **TINY_KVTC_SETTINGS),
                      chunks=tiny_kvtc_chunks(seed=7), progress=False)
    other.save(tmp_path / "other")
    fetched = _run(_fetch, redis_server.port, str(tmp_path / "other"), len(chunks), tuple(chunks[0].shape))
    assert fetched == [None, None]  # chunks of another calibration are misses, never garbage


def test_require_mac_without_a_key_refuses_to_start(calibrated, monkeypatch):
    from kvpack.integrations.lmcache_serde import build_kvtc_serde

    _, _, directory = calibrated
    monkeypatch.delenv("KVPACK_STORE_KEY", raising=False)
    with pytest.raises(ValueError, match="require_mac.*KVPACK_STORE_KEY is not"):
        build_kvtc_serde({"calibration": directory, "ratio": RATIO, "require_mac": True})
    with pytest.raises(ValueError, match="must be true or false"):
        build_kvtc_serde({"calibration": directory, "ratio": RATIO, "require_mac": "yes"})
    monkeypatch.setenv("KVPACK_STORE_KEY", "a key of sixteen bytes or more")
    # (on an AMX CPU the default vllm_cpu order is refused for its own reason; the key check is the point here)
    order = {"fused_order": "halves"} if torch.cpu._is_amx_tile_supported() else {}
    build_kvtc_serde({"calibration": directory, "ratio": RATIO, "require_mac": True, **order}).close()


@pytest.mark.slow
@needs_no_amx
def test_keyed_chunks_swapped_in_redis_are_misses(calibrated, real_chunks, redis_server, redis_url, monkeypatch):
    """Issue 17, item 9: with KVPACK_STORE_KEY, a writer to Redis who swaps two valid chunks (each
    intact, each of this calibration) gets misses, not the other chunk's KV; a reader without the
    key gets misses too."""
    _, _, directory = calibrated
    chunks, _ = real_chunks
    monkeypatch.setenv("KVPACK_STORE_KEY", "a key of sixteen bytes or more")  # inherited by the processes
    assert _run(_store, redis_server.port, directory, [c.numpy() for c in chunks]) == len(chunks)
    fetched = _run(_fetch, redis_server.port, directory, len(chunks), tuple(chunks[0].shape))
    assert all(f is not None for f in fetched)
    client = redis_server.client()
    first, second = sorted(client.keys("*"))
    a, b = client.get(first), client.get(second)
    client.set(first, b)
    client.set(second, a)
    assert _run(_fetch, redis_server.port, directory, len(chunks), tuple(chunks[0].shape)) == [None, None]
    client.set(first, a)
    client.set(second, b)
    monkeypatch.delenv("KVPACK_STORE_KEY")
    assert _run(_fetch, redis_server.port, directory, len(chunks), tuple(chunks[0].shape)) == [None, None]
