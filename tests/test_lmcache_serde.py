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
from kvpack.storage.kvtc.chunk import ChunkCodec, ChunkShape  # noqa: E402
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
    build_kvtc_serde({"calibration": directory, "ratio": RATIO, "require_mac": True}).close()


def test_loads_first_is_the_default_and_can_be_turned_off(calibrated):
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

    from kvpack.integrations.lmcache_serde import build_kvtc_serde
    from kvpack.integrations.serde_processor import LoadsFirstSerdeProcessor

    _, _, directory = calibrated
    for options, kind in (({}, LoadsFirstSerdeProcessor), ({"loads_first": True}, LoadsFirstSerdeProcessor),
                          ({"loads_first": False}, AsyncSerdeProcessor)):
        proc = build_kvtc_serde({"calibration": directory, "ratio": RATIO, **options})
        assert type(proc) is kind
        proc.close()
    with pytest.raises(ValueError, match="loads_first.*must be true or false"):
        build_kvtc_serde({"calibration": directory, "ratio": RATIO, "loads_first": "yes"})


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------------
# Variable-size (DEFLATE'd) objects: the serde's format, and what LMCache 0.5.6's adapters do with them
# ------------------------------------------------------------------------------------------------


class _Buffer:
    """What the serde reads from LMCache's MemoryObj: ``.tensor`` (the serializer's input or output)."""

    def __init__(self, tensor):
        self.tensor = tensor


def _codec(calibrated):
    from kvpack.storage.kvtc.codec import load_calibration

    return ChunkCodec(load_calibration(calibrated[2]), RATIO, fused_order="halves")


def test_deflated_objects_are_smaller_and_decode_as_the_fixed_size_ones(calibrated, real_chunks):
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    from kvpack.integrations.lmcache_serde import KvtcChunkDeserializer, KvtcChunkSerializer

    codec, chunk, key = _codec(calibrated), real_chunks[0][0], _keys(1)[0]
    layout = MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])
    decoded = []
    for level in (None, 6):
        serializer = KvtcChunkSerializer(codec, align=1, deflate_level=level)
        buffer = torch.zeros(serializer.estimate_serialized_size(layout), dtype=torch.uint8)
        size = serializer.serialize(_Buffer(chunk), _Buffer(buffer), key)
        out = torch.empty_like(chunk)
        KvtcChunkDeserializer(codec).deserialize(_Buffer(buffer), _Buffer(out), key)
        decoded.append((size, out))
    (fixed, a), (deflated, b) = decoded
    assert deflated < fixed == codec.serialized_size(codec.shape_of(chunk.shape), chunk.dtype)
    assert torch.equal(a, b)  # DEFLATE is lossless: the same chunk comes back


def test_corrupted_truncated_or_bomb_deflated_objects_are_refused(calibrated, real_chunks):
    import zlib

    from lmcache.v1.distributed.api import MemoryLayoutDesc

    from kvpack.integrations.lmcache_serde import DEFLATED_MAGIC, KvtcChunkDeserializer, KvtcChunkSerializer
    from kvpack.storage.kvtc.chunk import ChunkError

    codec, chunk, key = _codec(calibrated), real_chunks[0][0], _keys(1)[0]
    layout = MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])
    serializer = KvtcChunkSerializer(codec, align=1, deflate_level=6)
    buffer = torch.zeros(serializer.estimate_serialized_size(layout), dtype=torch.uint8)
    size = serializer.serialize(_Buffer(chunk), _Buffer(buffer), key)
    deserializer = KvtcChunkDeserializer(codec)

    def load(data: torch.Tensor, match: str):
        with pytest.raises(ChunkError, match=match):
            deserializer.deserialize(_Buffer(data), _Buffer(torch.empty_like(chunk)), key)

    flipped = buffer.clone()
    flipped[size // 2] ^= 0x10
    load(flipped, "does not inflate|inflates past|corrupted|checksum")  # a flipped bit may surface as any of them
    load(buffer[:size - 100], "states .* bytes")
    bomb = zlib.compress(bytes(10 * codec.serialized_size(codec.shape_of(chunk.shape), chunk.dtype)))
    head = DEFLATED_MAGIC + len(bomb).to_bytes(4, "little")
    load(torch.frombuffer(bytearray(head + bomb), dtype=torch.uint8), "inflates past")


def _fs_manager(base_path: str, calibration: str, deflate_level):
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    import kvpack.integrations.lmcache_serde  # noqa: F401 - registers "kvtc"

    serde = {"type": "kvtc", "calibration": calibration, "ratio": RATIO, "fused_order": "halves", "align": 1}
    if deflate_level is not None:
        serde["deflate_level"] = deflate_level
    adapter = {"type": "fs", "base_path": base_path, "serde": serde}
    return StorageManager(parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                                      "--l2-adapter", json.dumps(adapter)]))


@pytest.mark.slow
@pytest.mark.parametrize("deflate_level", [None, 6])
def test_filesystem_adapter_with_fixed_and_deflated_objects(calibrated, real_chunks, tmp_path, deflate_level):
    """LMCache 0.5.6's filesystem adapter writes the size the serializer reports, and loads an object
    only when the file fills the buffer the serde's size estimate sized: fixed-size kvtc objects round
    trip; DEFLATE'd ones are written smaller and then read as an incomplete file — a miss, never
    garbage. (When this test's second case starts hitting, LMCache reads variable-size objects: make
    DEFLATE the filesystem default.)"""
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, PrefetchTaskSpec

    _, calib, directory = calibrated
    chunk = real_chunks[0][0]
    key, layout = _keys(1)[0], MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])
    writer = _fs_manager(str(tmp_path), directory, deflate_level)
    objects = writer.reserve_write([key], layout)
    objects[key].tensor.copy_(chunk)
    writer.finish_write([key])
    deadline = time.monotonic() + 60
    while not list(tmp_path.rglob("*.data")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    writer.close()
    (stored,) = list(tmp_path.rglob("*.data"))
    fixed = ChunkCodec(calib, RATIO, fused_order="halves").serialized_size(ChunkShape.of(chunk.shape, "halves"),
                                                                           chunk.dtype)
    reader = _fs_manager(str(tmp_path), directory, deflate_level)
    handle = reader.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(
        keys=[key], object_group_id=0, layout_desc=layout)]))
    while (status := reader.query_prefetch_status(handle)) is None:
        time.sleep(0.02)
    try:
        if deflate_level is None:
            assert stored.stat().st_size == fixed and status.l2_hit_count == 1
            with reader.read_prefetched_results([key], status.l1_owners) as got:
                error = float((got[0].tensor - chunk).norm() / chunk.norm())
            reader.finish_read_prefetched([key])
            assert 0 < error < 0.5
        else:
            assert stored.stat().st_size < fixed and status.l2_hit_count == 0
    finally:
        reader.close()


@pytest.mark.parametrize("amx", [True, False])
def test_bf16_vllm_cpu_chunks_are_refused_where_vllm_uses_its_amx_layout(calibrated, real_chunks, monkeypatch, amx):
    """vLLM lays bf16 KV blocks out with its amx kernels on CPUs with AMX; the vllm_cpu order reads the
    'vec' layout it uses everywhere else (fp32 / fp16 caches there too)."""
    from kvpack.storage.kvtc.codec import load_calibration

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    codec = ChunkCodec(load_calibration(calibrated[2]), RATIO)  # fused_order vllm_cpu, the default
    separate = real_chunks[0][0]
    fused = torch.cat([separate[0], separate[1]], dim=-1)[None]  # any [1, L, 256, 2W] tensor: layout is not read
    data = codec.encode(fused)  # fp32: the vec layout on every CPU
    assert codec.decode(data).shape == fused.shape
    codec.encode(separate.to(torch.bfloat16))  # separate K and V: no vLLM block layout involved
    if amx:
        with pytest.raises(ValueError, match="bf16 vllm_cpu chunk on a CPU with AMX"):
            codec.encode(fused.to(torch.bfloat16))
        with pytest.raises(ValueError, match="bf16 vllm_cpu chunk on a CPU with AMX"):
            codec.decode(data, dtype=torch.bfloat16)
    else:
        codec.encode(fused.to(torch.bfloat16))
