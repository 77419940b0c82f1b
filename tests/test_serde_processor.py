"""LoadsFirstSerdeProcessor (kvpack/integrations/serde_processor.py) with LMCache's own
AsyncSerdeProcessor inside: a load submitted behind queued stores finishes before the stores
queued ahead of it, every task is done and reported once, a load's failure is reported as a
failure, and a load whose result is never collected delays a store chunk by ``max_defer_s`` only."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install -e '.[lmcache]'; .ci/run does)")

from kvpack.integrations.serde_processor import LoadGate, LoadsFirstSerdeProcessor  # noqa: E402

STEP_S = 0.05  # one fake chunk's work


class Journal:
    """What the fake serde halves did, in order: ("store", i) / ("load", i) when each chunk finished."""

    def __init__(self):
        self.events, self.lock = [], threading.Lock()

    def add(self, kind: str, item) -> None:
        with self.lock:
            self.events.append((kind, item))


class SlowSerializer:
    def __init__(self, journal: Journal):
        self.journal = journal

    def estimate_serialized_size(self, layout_desc) -> int:
        return 4096

    def serialize(self, src, dst, key) -> int:
        time.sleep(STEP_S)
        self.journal.add("store", key)
        return 4096


class SlowDeserializer:
    def __init__(self, journal: Journal, fail_on=None):
        self.journal, self.fail_on = journal, fail_on

    def deserialize(self, src, dst, key) -> None:
        time.sleep(STEP_S)
        if key == self.fail_on:
            raise ValueError("a corrupted chunk")
        self.journal.add("load", key)


def _wait(query, task_id, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while (result := query(task_id)) is None:
        assert time.monotonic() < deadline, "the task never finished"
        time.sleep(0.005)
    return result


def test_a_load_behind_queued_stores_runs_first_and_every_task_is_reported_once():
    journal = Journal()
    proc = LoadsFirstSerdeProcessor(SlowSerializer(journal), SlowDeserializer(journal))
    try:
        stores = [proc.submit_serialize([None] * 3, [None] * 3, [f"s{i}.{j}" for j in range(3)]) for i in range(4)]
        time.sleep(STEP_S / 2)  # the first store chunk is being encoded
        load = proc.submit_deserialize([None] * 3, [None] * 3, ["l0", "l1", "l2"])
        assert proc.gate.pending == 1
        assert _wait(proc.query_deserialize_result, load) is True
        assert proc.gate.pending == 0
        assert all(_wait(proc.query_serialize_result, t) is True for t in stores)
        # Exactly once: a second query finds nothing.
        assert proc.query_deserialize_result(load) is None and proc.query_serialize_result(stores[0]) is None
    finally:
        proc.close()
    order = [item for _, item in journal.events]
    assert sorted(order) == sorted([f"s{i}.{j}" for i in range(4) for j in range(3)] + ["l0", "l1", "l2"])
    last_load = order.index("l2")
    # At most the chunk already being encoded when the load came finishes before the load's last chunk.
    assert [x for x in order[:last_load] if x.startswith("s")] in ([], ["s0.0"]), order


def test_with_loads_first_off_the_same_load_waits_for_the_queue():
    """The ordering the processor exists to avoid, shown with LMCache's one pool."""
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

    journal = Journal()
    proc = AsyncSerdeProcessor(SlowSerializer(journal), SlowDeserializer(journal))
    try:
        stores = [proc.submit_serialize([None], [None], [f"s{i}"]) for i in range(4)]
        load = proc.submit_deserialize([None], [None], ["l0"])
        assert _wait(proc.query_deserialize_result, load) is True
        assert all(_wait(proc.query_serialize_result, t) for t in stores)
    finally:
        proc.close()
    assert [item for _, item in journal.events] == ["s0", "s1", "s2", "s3", "l0"]


def test_a_failed_load_is_reported_as_failed_and_releases_the_stores():
    journal = Journal()
    proc = LoadsFirstSerdeProcessor(SlowSerializer(journal), SlowDeserializer(journal, fail_on="l0"))
    try:
        load = proc.submit_deserialize([None] * 2, [None] * 2, ["l0", "l1"])
        assert _wait(proc.query_deserialize_result, load) is False
        assert proc.gate.pending == 0
        store = proc.submit_serialize([None], [None], ["s0"])
        start = time.monotonic()
        assert _wait(proc.query_serialize_result, store) is True
        assert time.monotonic() - start < 2.0  # not held by the failed load
    finally:
        proc.close()


def test_an_uncollected_load_delays_a_store_chunk_by_max_defer_only():
    journal = Journal()
    proc = LoadsFirstSerdeProcessor(SlowSerializer(journal), SlowDeserializer(journal), max_defer_s=0.5)
    try:
        proc.submit_deserialize([None], [None], ["l0"])  # its result is never queried: it stays pending
        time.sleep(3 * STEP_S)
        start = time.monotonic()
        store = proc.submit_serialize([None], [None], ["s0"])
        assert _wait(proc.query_serialize_result, store) is True
        waited = time.monotonic() - start
        assert 0.5 <= waited < 0.5 + 2.0, waited
    finally:
        proc.close()


def test_the_gate_refuses_a_non_positive_deferral():
    with pytest.raises(ValueError, match="max_defer_s must be > 0"):
        LoadGate(0)
