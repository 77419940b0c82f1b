"""Prefix stores, both backends (a directory, a real Redis server on 127.0.0.1): longest-prefix lookup,
verified reads, corrupted and foreign entries refused, crash safety, concurrency across processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest

from kvpack.storage.kvtc.session import compress_tokens
from kvpack.store import CorruptEntryError, PrefixStore, RedisPrefixStore, open_prefix_store
from kvpack.store.format import BlobError

from .helpers import RedisServer, tiny_kvtc, token_ids

BACKENDS = ("disk", "redis")


@pytest.fixture(scope="module")
def tiny():
    return tiny_kvtc()


def _entry(tiny, n, ratio=8, seed=9):
    model, calib = tiny
    ids = token_ids(60, seed=seed)[:n]
    return ids, compress_tokens(model, calib, ids, ratio)


@pytest.fixture(scope="module")
def prefix_entries(tiny):
    """Blobs of the first 30 and of the first 45 tokens of one sequence (an entry and its extension)."""
    return _entry(tiny, 30), _entry(tiny, 45)


@pytest.fixture(scope="module")
def other_blob_30(tiny, prefix_entries):
    """The same 30 tokens at ratio 16: a different blob for the same store key."""
    model, calib = tiny
    return compress_tokens(model, calib, prefix_entries[0][0], 16)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    if request.param == "disk":
        return open_prefix_store(tmp_path / "store")
    return open_prefix_store(request.getfixturevalue("redis_url"))


def _keys(calib):
    return calib.fingerprint["hash"], calib.calibration_id


def test_location_picks_the_backend(tmp_path, redis_url):
    assert isinstance(open_prefix_store(tmp_path), PrefixStore)
    redis_store = open_prefix_store(redis_url + "?ttl=60&prefix=team")
    assert isinstance(redis_store, RedisPrefixStore) and redis_store.ttl == 60 and redis_store.key_prefix == "team"
    with pytest.raises(ValueError, match="unknown prefix-store option"):
        open_prefix_store(redis_url + "?ttl=60&maxbytes=9")
    with pytest.raises(ValueError, match="ttl must be"):
        open_prefix_store(redis_url + "?ttl=soon")
    shown = RedisPrefixStore.from_url("redis://user:secret@127.0.0.1:1/0").where
    assert "secret" not in shown and "127.0.0.1:1" in shown


def test_put_get_longest_prefix(tiny, prefix_entries, store):
    _, calib = tiny
    (ids30, blob30), (ids45, blob45) = prefix_entries
    store.put(blob30, ids30)
    store.put(blob45, ids45)
    mh, cid = _keys(calib)
    # 45 and 30 exactly; each entry also under its leading n-1 ... n-16 tokens (aliases): 44..29 and 29..14
    assert store.lengths(mh, cid) == list(range(45, 13, -1))
    assert store.get(mh, cid, ids30) == blob30
    assert store.get(mh, cid, ids30[:-1]) == blob30  # an alias: a blob that begins with those tokens
    assert store.get(mh, cid, ids30[:13]) is None  # past the alias range
    assert store.get(mh, cid, ids30[:-1] + [ids30[-1] ^ 1]) is None
    longer = token_ids(60)
    assert store.longest_prefix(mh, cid, longer) == (45, blob45)
    assert store.longest_prefix(mh, cid, longer[:44]) == (44, blob45)  # blob45's leading 44 tokens
    assert store.longest_prefix(mh, cid, longer[:44], whole=True) == (30, blob30)
    assert store.longest_prefix(mh, cid, longer[:30] + [1, 2]) == (30, blob30)  # the exact entry wins
    assert store.longest_prefix(mh, cid, token_ids(60, seed=1)) is None
    assert store.longest_prefix(mh, "0" * 16, longer) is None  # another calibration sees nothing
    with pytest.raises(BlobError, match="does not describe"):
        store.put(blob30, ids45)


def test_an_exact_entry_replaces_an_alias_and_an_alias_never_replaces_it(tiny, prefix_entries, store):
    _, calib = tiny
    (ids30, blob30), (ids45, blob45) = prefix_entries
    mh, cid = _keys(calib)
    store.put(blob45, ids45)
    assert store.get(mh, cid, ids30) == blob45  # an alias of the 45-token entry
    store.put(blob30, ids30)
    assert store.get(mh, cid, ids30) == blob30
    store.put(blob45, ids45)  # written again: its alias at 30 does not displace the exact entry
    assert store.get(mh, cid, ids30) == blob30


def _corrupt(store, blob, ids, calib):
    """Flip one byte of the stored entry in place."""
    if isinstance(store, PrefixStore):
        path = store.path(*_keys(calib), ids)
        data = bytearray(path.read_bytes())
        data[200] ^= 1
        path.write_bytes(bytes(data))
        return
    key = store._blob_key(hashlib.sha256(blob).hexdigest())  # noqa: SLF001 - the test plays the attacker
    data = bytearray(store.client.get(key))
    data[200] ^= 1
    store.client.set(key, bytes(data))


def test_corrupted_entry_reported_never_returned(tiny, prefix_entries, store):
    _, calib = tiny
    (ids30, blob30), (ids45, blob45) = prefix_entries
    store.put(blob30, ids30)
    store.put(blob45, ids45)
    _corrupt(store, blob45, ids45, calib)
    mh, cid = _keys(calib)
    with pytest.raises(CorruptEntryError, match="corrupted"):
        store.get(mh, cid, ids45)
    with pytest.warns(UserWarning, match="corrupted"):
        assert store.longest_prefix(mh, cid, token_ids(60)) == (30, blob30)


def test_redis_foreign_entry_is_refused(tiny, prefix_entries, redis_url):
    """An index entry that names a valid blob of another prefix (an intact but foreign entry) is refused."""
    _, calib = tiny
    store = open_prefix_store(redis_url)
    (ids30, blob30), _ = prefix_entries
    other_ids, other = _entry(tiny, 45, seed=1)  # tokens that do not begin with ids30
    store.put(blob30, ids30)
    store.put(other, other_ids)
    mh, cid = _keys(calib)
    index = store._index_key(mh, cid)  # noqa: SLF001 - the test plays the attacker
    store.client.hset(index, store._field(ids30), hashlib.sha256(other).hexdigest())  # noqa: SLF001
    with pytest.raises(CorruptEntryError, match="different model, calibration or prefix"):
        store.get(mh, cid, ids30)
    store.client.set(store._blob_key("0" * 64), blob30)  # noqa: SLF001 - bytes under the wrong content key
    store.client.hset(index, store._field(ids30), "0" * 64)  # noqa: SLF001
    with pytest.raises(CorruptEntryError, match="do not hash to their key"):
        store.get(mh, cid, ids30)


def test_redis_vanished_blob_is_a_miss_and_forgotten(tiny, prefix_entries, redis_url):
    _, calib = tiny
    store = open_prefix_store(redis_url + "?ttl=1")
    (ids30, blob30), (ids45, blob45) = prefix_entries
    store.put(blob30, ids30)
    store.client.delete(store._blob_key(hashlib.sha256(blob30).hexdigest()))  # noqa: SLF001 - as an eviction would
    mh, cid = _keys(calib)
    assert store.get(mh, cid, ids30) is None
    assert store.client.hget(store._index_key(mh, cid), store._field(ids30)) is None  # noqa: SLF001 - forgotten
    store.put(blob45, ids45)
    assert store.client.ttl(store._blob_key(hashlib.sha256(blob45).hexdigest())) in (0, 1)  # noqa: SLF001
    time.sleep(2.2)
    assert store.get(mh, cid, ids45) is None and store.longest_prefix(mh, cid, ids45) is None


def test_redis_lru_cap_evicts_and_never_returns_garbage(tiny, tmp_path):
    """Redis' own byte cap (maxmemory + allkeys-lru): old entries are evicted, what is returned is whole."""


    model, calib = tiny
    server = RedisServer(tmp_path, extra=("--maxmemory-policy", "allkeys-lru"))
    try:
        store = open_prefix_store(server.url)
        entries = [_entry(tiny, 20 + (i % 40), ratio=2, seed=100 + i) for i in range(120)]
        total = sum(len(blob) for _, blob in entries)
        client = server.client()
        # A cap of a third of the entries' bytes above what the empty server uses.
        client.config_set("maxmemory", client.info("memory")["used_memory"] + total // 3)
        for ids, blob in entries:
            store.put(blob, ids)
        mh, cid = _keys(calib)
        found = [store.get(mh, cid, ids) for ids, _ in entries]
        kept = [f for f in found if f is not None]
        assert 0 < len(kept) < len(entries), "the cap should evict some entries and keep others"
        assert all(f is None or f == blob for f, (_, blob) in zip(found, entries))
    finally:
        server.stop()


def test_disk_failed_write_keeps_previous_entry(prefix_entries, other_blob_30, tmp_path, monkeypatch):
    store = PrefixStore(tmp_path)
    ids, blob = prefix_entries[0]
    path = store.put(blob, ids)

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        store.put(other_blob_30, ids)
    assert path.read_bytes() == blob
    assert not [p.name for p in path.parent.iterdir() if ".tmp-" in p.name]  # no temporary file left behind


def test_concurrent_readers_see_whole_entries(tiny, prefix_entries, other_blob_30, store):
    _, calib = tiny
    ids, blob_a = prefix_entries[0]
    blob_b = other_blob_30
    store.put(blob_a, ids)
    mh, cid = _keys(calib)
    seen, errors = set(), []

    def reader():
        for _ in range(60):
            try:
                seen.add(store.get(mh, cid, ids))
            except Exception as exc:  # noqa: BLE001 - any failure is the test's finding
                errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for j in range(30):
        store.put(blob_b if j % 2 else blob_a, ids)
    for t in threads:
        t.join()
    assert not errors and seen <= {blob_a, blob_b}


# ------------------------------------------------------------------------------------------------
# Several processes on one Redis server
# ------------------------------------------------------------------------------------------------


def _writer(url: str, entries: list, rounds: int, ready) -> None:
    store = open_prefix_store(url)
    ready.set()
    for _ in range(rounds):
        for ids, blob in entries:
            store.put(blob, ids)


def _reader(url: str, mh: str, cid: str, entries: list, rounds: int, out) -> None:
    store = open_prefix_store(url)
    valid = {tuple(ids): {blob for i2, blob in entries if i2 == ids} for ids, _ in entries}
    bad, hits = 0, 0
    for _ in range(rounds):
        for ids, _ in entries:
            got = store.get(mh, cid, ids)
            if got is not None:
                hits += 1
                bad += got not in valid[tuple(ids)]
    out.put((hits, bad))


@pytest.mark.slow
def test_two_writer_processes_and_a_reader_lose_nothing(tiny, redis_url):
    _, calib = tiny
    mh, cid = _keys(calib)
    # Two writers store different blobs (ratios 8 and 16) of the same prefixes, and blobs of their own.
    shared = [_entry(tiny, n) for n in (24, 36, 48)]
    shared_b = [(ids, compress_tokens(tiny[0], calib, ids, 16)) for ids, _ in shared]
    own_a = [_entry(tiny, n, seed=31) for n in (20, 40)]
    own_b = [_entry(tiny, n, seed=32) for n in (22, 44)]
    ctx = multiprocessing.get_context("spawn")
    ready_a, ready_b, out = ctx.Event(), ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(redis_url, shared + own_a, 40, ready_a)),
               ctx.Process(target=_writer, args=(redis_url, shared_b + own_b, 40, ready_b))]
    everything = shared + shared_b + own_a + own_b
    reader = ctx.Process(target=_reader, args=(redis_url, mh, cid, everything, 40, out))
    for p in writers:
        p.start()
    assert ready_a.wait(60) and ready_b.wait(60)
    reader.start()
    for p in [*writers, reader]:
        p.join(180)
        assert p.exitcode == 0
    hits, bad = out.get(timeout=10)
    assert bad == 0 and hits > 0
    store = open_prefix_store(redis_url)
    for ids, blob in own_a + own_b:  # every writer's own entry is there, whole
        assert store.get(mh, cid, ids) == blob
    for (ids, a), (_, b) in zip(shared, shared_b):  # the last writer won, with a whole blob
        assert store.get(mh, cid, ids) in (a, b)


def _half_sent_set(port: int, key: str, size: int, sent) -> None:
    """Send a SET of ``size`` bytes, stop half-way and wait to be killed (a writer dying mid-transfer)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"*3\r\n$3\r\nSET\r\n${len(key)}\r\n{key}\r\n${size}\r\n".encode() + b"x" * (size // 2))
    sent.set()
    time.sleep(600)


def _putting_forever(url: str, entries: list, started) -> None:
    store = open_prefix_store(url)
    started.set()
    while True:
        for ids, blob in entries:
            store.put(blob, ids)


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_nothing_half_written(tiny, redis_server, redis_url):
    _, calib = tiny
    mh, cid = _keys(calib)
    ctx = multiprocessing.get_context("spawn")
    # 1. Killed in the middle of sending a blob: the server applies the command whole or not at all.
    sent = ctx.Event()
    key = "kvpack:blob:" + "f" * 64
    half = ctx.Process(target=_half_sent_set, args=(redis_server.port, key, 8 << 20, sent))
    half.start()
    assert sent.wait(60)
    os.kill(half.pid, signal.SIGKILL)
    half.join(30)
    client = redis_server.client()
    deadline = time.monotonic() + 10
    while client.exists(key) == 0 and time.monotonic() < deadline and len(client.client_list()) > 1:
        time.sleep(0.05)  # the server notices the dead connection
    assert client.exists(key) == 0
    # 2. Killed at a random moment while storing entry after entry: every entry readable is whole.
    entries = [_entry(tiny, n, seed=50 + n) for n in range(20, 56, 3)]
    for kill_after in (0.05, 0.2, 0.5):
        started = ctx.Event()
        writer = ctx.Process(target=_putting_forever, args=(redis_url, entries, started))
        writer.start()
        assert started.wait(60)
        time.sleep(kill_after)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        store = open_prefix_store(redis_url)
        for ids, blob in entries:
            got = store.get(mh, cid, ids)  # raises CorruptEntryError on anything torn
            assert got is None or got == blob
        index = client.hgetall(store._index_key(mh, cid))  # noqa: SLF001 - every published entry has its blob
        assert all(client.exists(store._blob_key(d.decode())) for d in index.values())  # noqa: SLF001


# ------------------------------------------------------------------------------------------------
# Disk store: malformed entries, crash leftovers (issue 17, items 5 and 6)
# ------------------------------------------------------------------------------------------------


def test_disk_lookup_skips_what_is_not_an_entry_and_never_blocks(tiny, prefix_entries, tmp_path):
    _, calib = tiny
    (ids30, blob30), (ids45, _) = prefix_entries
    store = PrefixStore(tmp_path, max_entry_bytes=1 << 20)
    store.put(blob30, ids30)
    mh, cid = _keys(calib)
    longer = token_ids(60)
    directory = store.path(mh, cid, ids30).parent
    hostile = [store.path(mh, cid, longer[:n]) for n in (50, 48, 46, 44)]
    hostile[0].mkdir()  # a directory named like an entry
    os.mkfifo(hostile[1])  # a FIFO: opening it for reading would block
    hostile[2].symlink_to("/dev/zero")  # reading it would never end
    hostile[3].write_bytes(bytes((1 << 20) + 1))  # larger than an entry may be
    (directory / "notes.txt").write_text("a stray file")
    result = []
    lookup = threading.Thread(target=lambda: result.append(store.longest_prefix(mh, cid, longer)))
    with pytest.warns(UserWarning) as warned:
        lookup.start()
        lookup.join(20)
    assert not lookup.is_alive(), "the lookup blocked"
    assert result == [(30, blob30)]
    messages = " ".join(str(w.message) for w in warned)
    assert messages.count("not a regular file") == 3 and "more than the" in messages and "notes.txt" in messages


def test_disk_store_removes_crashed_writers_leftovers_on_open(tiny, prefix_entries, tmp_path, monkeypatch):
    import kvpack.store.atomic as atomic

    _, calib = tiny
    ids, blob = prefix_entries[0]
    synced = []
    monkeypatch.setattr(atomic, "fsync_directory", lambda d: synced.append(d))
    path = PrefixStore(tmp_path).put(blob, ids)
    assert synced == [path.parent]  # the rename is made durable
    old, fresh = path.parent / f"{path.name}.tmp-old", path.parent / f"{path.name}.tmp-live"
    old.write_bytes(b"x" * 1000)
    fresh.write_bytes(b"y" * 1000)
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # two hours old: a crashed writer's
    PrefixStore(tmp_path)
    assert not old.exists() and fresh.exists() and path.exists()  # a live writer's file is kept


def _relabelled(blob: bytes, ids: list[int]) -> bytes:
    """``blob`` claiming to hold ``ids`` (same length), with a recomputed checksum: what someone who can
    write to the store can forge without any key."""
    import zlib

    import torch

    from kvpack.store.format import tokens_digest

    from .helpers import join_blob, split_blob

    header, data = split_blob(blob)
    data["token_ids"] = zlib.compress(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
    header["tokens_sha256"] = tokens_digest(ids)
    return join_blob(header, data)


STORE_KEY = "correct horse battery staple"


def _store(backend, tmp_path, redis_url, key=None):
    location = tmp_path / "store" if backend == "disk" else redis_url
    return open_prefix_store(location, key=key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_relabelled_entry_is_returned_without_a_key_and_refused_with_one(tiny, prefix_entries, backend, tmp_path,
                                                                           request):
    """Issue 17, item 9: the checksum is no defence against a writer (documented: trusted storage);
    a store with a MAC key returns only entries sealed under that key."""
    _, calib = tiny
    redis_url = request.getfixturevalue("redis_url") if backend == "redis" else None
    (ids30, blob30), _ = prefix_entries
    victim = token_ids(30, seed=77)
    forged = _relabelled(blob30, victim)
    mh, cid = _keys(calib)
    plain = _store(backend, tmp_path, redis_url)
    plain.put(forged, victim)
    assert plain.get(mh, cid, victim) == forged  # the trust boundary: accepted without a key

    keyed = _store(backend, tmp_path, redis_url, key=STORE_KEY)
    with pytest.raises(CorruptEntryError, match="not sealed"):
        keyed.get(mh, cid, victim)
    keyed.put(blob30, ids30)
    assert keyed.get(mh, cid, ids30) == blob30
    with pytest.warns(UserWarning, match="sealed with a key"):
        assert plain.longest_prefix(mh, cid, ids30 + [1]) is None  # a reader without the key gets nothing
    with pytest.raises(CorruptEntryError, match="does not verify"):
        _store(backend, tmp_path, redis_url, key=STORE_KEY + "!").get(mh, cid, ids30)


def test_store_key_from_the_environment_and_too_short(tiny, prefix_entries, tmp_path, monkeypatch):
    _, calib = tiny
    (ids30, blob30), _ = prefix_entries
    monkeypatch.setenv("KVPACK_STORE_KEY", STORE_KEY)
    store = open_prefix_store(tmp_path)
    path = store.put(blob30, ids30)
    assert path.read_bytes().startswith(b"KVPACKS\x01") and store.get(*_keys(calib), ids30) == blob30
    monkeypatch.setenv("KVPACK_STORE_KEY", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        open_prefix_store(tmp_path)
