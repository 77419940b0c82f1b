"""``RedisPrefixStore``: the prefix store on a Redis server, shared by processes and machines.

Same semantics as the disk store (:mod:`kvpack.store.prefix`): longest-prefix lookup by token ids,
every entry verified on read, a corrupted or foreign entry refused (``get``) or skipped with a warning
(``longest_prefix``), never returned.

Keys (``P`` = the key prefix, ``kvpack`` by default; ``M``/``C`` = model hash / calibration id):

* ``P:blob:<sha256 of the blob>`` — the blob's bytes, stored under its content;
* ``P:index:M:C`` — a hash: field ``<n>-<sha256 of the tokens>`` → the blob's sha256 (also for the
  entry's leading ``n - 1`` … ``n - ALIAS_TOKENS`` tokens, set only where no field exists: aliases);
* ``P:lengths:M:C`` — a sorted set of the stored prefix lengths.

A write stores the blob under its content key first (one ``SET``: Redis applies a command whole or
not at all, so a writer killed mid-transfer leaves nothing), then publishes the index field and the
length in one ``MULTI``/``EXEC`` transaction. A reader follows the index to a content key and checks
that the bytes hash to that key and verify as a blob of the asked model, calibration and tokens, so
it never sees a half-published or substituted entry. Concurrent writers of one prefix each publish a
complete blob; the last transaction wins.

Expiry and size: ``ttl`` (seconds, optional) puts an expiry on the blob and refreshes it on the index
keys at every write; an index entry whose blob expired or was evicted is a miss and is removed. For a
byte cap, give the server ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru`` (or
``volatile-lru`` with a ``ttl``): Redis then evicts the least recently used keys itself; an evicted
blob is a miss, an evicted index forgets its prefixes (the blobs it named expire or are evicted in
turn). Nothing evicted is ever returned as something else.
"""

from __future__ import annotations

import hashlib
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis

from .format import tokens_digest
from .mac import seal, store_key
from .prefix import CorruptEntryError, PrefixStoreBase, alias_lengths, check_names, entry_identity, verified_entry

DEFAULT_KEY_PREFIX = "kvpack"


class RedisPrefixStore(PrefixStoreBase):
    """Prefix store on a Redis server.

    Args:
        client: a ``redis.Redis`` client (binary responses, i.e. ``decode_responses=False``).
        ttl: seconds an entry lives after its last write (None: no expiry).
        key_prefix: namespace of every key (several stores can share one server).
        where: how the store names itself in messages (the URL).
        key: MAC key (default ``$KVPACK_STORE_KEY`` if set): entries are written sealed with
            HMAC-SHA256 and only entries whose MAC verifies are read (``kvpack.store.mac``) — what a
            server shared with other writers should require.
    """

    def __init__(self, client: redis.Redis, ttl: int | None = None, key_prefix: str = DEFAULT_KEY_PREFIX,
                 where: str = "redis", key: bytes | str | None = None):
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        if not key_prefix or ":" in key_prefix:
            raise ValueError(f"key_prefix must be a non-empty string without ':', got {key_prefix!r}")
        self.client, self.ttl, self.key_prefix, self.where = client, ttl, key_prefix, where
        self.key = store_key(key)

    @classmethod
    def from_url(cls, url: str, key: bytes | str | None = None) -> RedisPrefixStore:
        """``redis://[user:password@]host:port/db[?ttl=SECONDS&prefix=NAME]`` (also ``rediss://``, ``unix://``)."""
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        unknown = sorted(set(query) - {"ttl", "prefix"})
        if unknown:
            raise ValueError(f"unknown prefix-store option(s) {unknown} in {url!r}; known: ttl, prefix")
        try:
            ttl = int(query["ttl"][-1]) if "ttl" in query else None
        except ValueError:
            raise ValueError(f"ttl must be a whole number of seconds, got {query['ttl'][-1]!r}") from None
        prefix = query["prefix"][-1] if "prefix" in query else DEFAULT_KEY_PREFIX
        client = redis.Redis.from_url(urlunsplit(parts._replace(query="")), decode_responses=False)
        netloc = parts.netloc
        if parts.password:  # never print a password
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        shown = urlunsplit(parts._replace(netloc=netloc, query=""))
        return cls(client, ttl=ttl, key_prefix=prefix, where=shown, key=key)

    # -- keys ---------------------------------------------------------------------------------

    def _blob_key(self, digest: str) -> str:
        return f"{self.key_prefix}:blob:{digest}"

    def _index_key(self, model_hash: str, calibration_id: str) -> str:
        check_names(model_hash, calibration_id)
        return f"{self.key_prefix}:index:{model_hash}:{calibration_id}"

    def _lengths_key(self, model_hash: str, calibration_id: str) -> str:
        check_names(model_hash, calibration_id)
        return f"{self.key_prefix}:lengths:{model_hash}:{calibration_id}"

    @staticmethod
    def _field(token_ids: list[int]) -> str:
        return f"{len(token_ids)}-{tokens_digest(token_ids)}"

    # -- the store ----------------------------------------------------------------------------

    def put(self, blob: bytes, token_ids: list[int]) -> str:
        model_hash, calibration_id = entry_identity(blob, token_ids)
        blob = seal(blob, self.key)
        digest = hashlib.sha256(blob).hexdigest()
        blob_key = self._blob_key(digest)
        index, lengths = self._index_key(model_hash, calibration_id), self._lengths_key(model_hash, calibration_id)
        # 1. the content, whole (one command); 2. the index entry, published atomically.
        self.client.set(blob_key, blob, ex=self.ttl)
        with self.client.pipeline(transaction=True) as tx:
            tx.hset(index, self._field(token_ids), digest)
            tx.zadd(lengths, {str(len(token_ids)): len(token_ids)})
            for n in alias_lengths(len(token_ids)):  # an exact entry of those tokens keeps its field
                tx.hsetnx(index, self._field(token_ids[:n]), digest)
                tx.zadd(lengths, {str(n): n})
            if self.ttl is not None:
                tx.expire(index, self.ttl)
                tx.expire(lengths, self.ttl)
            tx.execute()
        return f"{self.where} {blob_key}"

    def get(self, model_hash: str, calibration_id: str, token_ids: list[int]) -> bytes | None:
        index = self._index_key(model_hash, calibration_id)
        field = self._field(token_ids)
        digest = self.client.hget(index, field)
        if digest is None:
            return None
        digest = digest.decode("ascii", errors="replace")
        blob_key = self._blob_key(digest)
        data = self.client.get(blob_key)
        if data is None:  # expired or evicted: a miss; forget the entry (only if it still names that blob)
            self._forget(index, field, digest)
            return None
        where = f"{self.where} {blob_key} ({field})"
        if hashlib.sha256(data).hexdigest() != digest:
            raise CorruptEntryError(f"store entry {where} is corrupted: its bytes do not hash to their key")
        return verified_entry(data, where, model_hash, calibration_id, token_ids, self.key)

    def _forget(self, index: str, field: str, digest: str) -> None:
        # Remove the field only if it still names the vanished blob (a newer writer may have replaced it).
        self.client.eval("if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then "
                         "return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0", 1, index, field, digest)

    def lengths(self, model_hash: str, calibration_id: str) -> list[int]:
        members = self.client.zrevrange(self._lengths_key(model_hash, calibration_id), 0, -1)
        out = []
        for m in members:
            text = m.decode("ascii", errors="replace")
            if text.isdigit():
                out.append(int(text))
        return out
