"""An LMCache ``SerdeProcessor`` that serves loads before stores.

LMCache's ``AsyncSerdeProcessor`` runs serialize and deserialize tasks on one thread pool, first in,
first out. With a codec that costs CPU (kvtc: a chunk's encode is a PCA projection and a quantizer,
its decode the inverse PCA's multiply-adds), a request's prefetch then waits behind every chunk
the store path queued before it. Measured through vLLM + LMCache + Redis at 4K tokens on 2 cores
(issue 27; docs/methods/kvtc.md, under a profiler, fp32 inverse PCA): the 15 chunks of a restored prefix
took 10.1 s to prefetch while the previous request's 15 chunks were being encoded; with this
processor (and the bf16 inverse PCA) 0.8-1.2 s.

:class:`LoadsFirstSerdeProcessor` keeps two ``AsyncSerdeProcessor``s behind LMCache's interface — one
whose pool runs only stores, one whose pool runs only loads — and holds a store's next chunk while
a load task is pending (submitted and not yet reported done), for at most ``max_defer_s`` per chunk,
so stores are delayed, never dropped or starved. A store chunk already being encoded when a load
arrives finishes alongside it. Only LMCache's public serde interface is used.
"""

from __future__ import annotations

import os
import threading

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage telemetry from anything kvpack starts

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor  # noqa: E402
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, SerdeTaskId, Serializer  # noqa: E402
from lmcache.v1.memory_management import MemoryObj  # noqa: E402

DEFAULT_MAX_DEFER_S = 10.0  # the longest a store's chunk waits for pending loads


class LoadGate:
    """Counts the pending load tasks; stores wait on it until none is pending (or a timeout)."""

    def __init__(self, max_defer_s: float = DEFAULT_MAX_DEFER_S):
        if not max_defer_s > 0:
            raise ValueError(f"max_defer_s must be > 0, got {max_defer_s}")
        self.max_defer_s = max_defer_s
        self._pending = 0
        self._changed = threading.Condition()

    @property
    def pending(self) -> int:
        with self._changed:
            return self._pending

    def load_submitted(self) -> None:
        with self._changed:
            self._pending += 1

    def load_finished(self) -> None:
        with self._changed:
            self._pending = max(0, self._pending - 1)
            self._changed.notify_all()

    def wait_for_loads(self) -> bool:
        """Block until no load is pending or ``max_defer_s`` passed; True when none is pending."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending == 0, timeout=self.max_defer_s)


class _DeferredSerializer(Serializer):
    """``inner``, each chunk's encode held while loads are pending."""

    def __init__(self, inner: Serializer, gate: LoadGate):
        self.inner, self.gate = inner, gate

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return self.inner.estimate_serialized_size(layout_desc)

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        self.gate.wait_for_loads()
        return self.inner.serialize(src, dst, key)


class LoadsFirstSerdeProcessor(SerdeProcessor):
    """Stores on one pool, loads on another, a store's chunk held while a load is pending.

    Args:
        serializer, deserializer: the serde's synchronous halves.
        max_workers: threads of each pool (LMCache's default: 1).
        max_defer_s: the longest one store chunk waits for pending loads.
    """

    def __init__(self, serializer: Serializer, deserializer: Deserializer, max_workers: int = 1,
                 max_defer_s: float = DEFAULT_MAX_DEFER_S):
        self.gate = LoadGate(max_defer_s)
        self._stores = AsyncSerdeProcessor(_DeferredSerializer(serializer, self.gate), deserializer, max_workers)
        self._loads = AsyncSerdeProcessor(serializer, deserializer, max_workers)

    def get_serialize_event_fd(self) -> int:
        return self._stores.get_serialize_event_fd()

    def get_deserialize_event_fd(self) -> int:
        return self._loads.get_deserialize_event_fd()

    def submit_serialize(self, src_objs: list[MemoryObj], dst_objs: list[MemoryObj],
                         keys: list[ObjectKey]) -> SerdeTaskId:
        return self._stores.submit_serialize(src_objs, dst_objs, keys)

    def query_serialize_result(self, task_id: SerdeTaskId) -> bool | None:
        return self._stores.query_serialize_result(task_id)

    def submit_deserialize(self, src_objs: list[MemoryObj], dst_objs: list[MemoryObj],
                           keys: list[ObjectKey]) -> SerdeTaskId:
        self.gate.load_submitted()
        try:
            return self._loads.submit_deserialize(src_objs, dst_objs, keys)
        except BaseException:
            self.gate.load_finished()
            raise

    def query_deserialize_result(self, task_id: SerdeTaskId) -> bool | None:
        # A task's result is returned exactly once (LMCache pops it): that is when it stops being pending.
        result = self._loads.query_deserialize_result(task_id)
        if result is not None:
            self.gate.load_finished()
        return result

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return self._stores.estimate_serialized_size(layout_desc)

    def close(self) -> None:
        try:
            self._stores.close()
        finally:
            self._loads.close()
