"""A rank worker's tasks: swap, store, load and lookup, executed for the requests its frame server reads.

``TaskServer.execute`` is the frame server's ``execute`` callback (``kvcached.daemon.frames``). A task is checked before
anything moves: an invalid one is answered INVALID with nothing changed; store calls have a deadline
(``kvcached.daemon.store_agent``): a slow store fails its task (FAILED, ``store_unavailable``). Handing over (``kvcached
restart``, ``stop --keep``), every task that still arrives is answered NOT_RUN, so its client sends it to the next
daemon.

Keys: a ``swap_out`` with keys enters its CPU blocks in the rank's key directory (``kvcached.daemon.keydir``) once
copied, and writes them through to the store when there is one; ``lookup`` and ``load`` find each key in the CPU pool
first, then in the store.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time

import numpy as np

from kvcached.copy_engine import Array, SwapEngine
from kvcached.daemon.frames import PAYLOAD_AT, Client, Request
from kvcached.daemon.keydir import KeyDirectory
from kvcached.daemon.store_agent import StoreCalls
from kvcached.logs import Logger
from kvcached.protocol.errors import InvalidTask, StoreUnavailable
from kvcached.protocol.messages import FLAG_KEYS, KEY_BYTES, TASK_RESULT, Op, Status, reply, unpack_ids, unpack_keyed
from kvcached.protocol.stats import StatsSlot
from kvcached.store.base import REPUBLISH_COUNTERS, StoreCounters

#: Keys of a client's next load passed to the store ahead of it (more than a store looks up at once).
AHEAD_KEYS = 64


class TaskServer:
    """Executes tasks for one rank. ``stats`` is the rank's slot in the control block."""

    def __init__(
        self,
        *,
        engine: SwapEngine,
        stats: StatsSlot,
        rank: int,
        generation: int,
        log: Logger,
        store: StoreCalls | None = None,
        keys: KeyDirectory | None = None,
    ) -> None:
        self.engine = engine
        self.stats = stats
        self.rank = rank
        self.generation = generation
        self.log = log
        self.store = store
        self.keys = keys  # the CPU pool's key directory (None without a pool)
        self.store_failures = 0  # store tasks that failed (the backend counts its own errors besides)
        self.store_was_unavailable = False  # what the log last said of it (``_mirror_store_counters``)
        self.republishing = False  # what the log last said of putting back what the store's master forgot
        self.handing_over = False  # set when handing over: tasks are answered NOT_RUN, the next daemon runs them
        self._mirror_store_counters()  # a rebuilt index shows in status before the first task

    def execute(self, client: Client, request: Request) -> bytes:
        op, flags, task_id, payload = request
        try:
            if op == Op.HELLO:
                return self._hello(client, task_id, payload)
            if not client.greeted:
                raise InvalidTask("hello", "send HELLO with the daemon generation first")
            if self.handing_over:
                message = "not run: this daemon is handing the rank over to the next one; send it there"
                return reply(op, Status.NOT_RUN, task_id, {"message": message})
            if op in (Op.SWAP_OUT, Op.SWAP_IN):
                return self._swap(Op(op), flags, task_id, payload)
            if op in (Op.STORE, Op.LOAD, Op.LOOKUP):
                try:
                    return self._store_task(Op(op), task_id, payload, client)
                finally:
                    self._mirror_store_counters()
            raise InvalidTask("op", f"unknown operation {op}; known: {', '.join(o.name for o in Op)}")
        except InvalidTask as exc:
            self.stats.count(tasks_refused=1)
            return reply(op, Status.INVALID, task_id, {"field": exc.field, "message": exc.message})
        except StoreUnavailable as exc:
            self._store_failed()
            body = {"message": f"storage backend unavailable: {exc}", "store_unavailable": True}
            return reply(op, Status.FAILED, task_id, body)
        except Exception as exc:
            if op in (Op.SWAP_OUT, Op.SWAP_IN):
                self.stats.count(swap_failures=1)
            if op in (Op.STORE, Op.LOAD, Op.LOOKUP) or flags & FLAG_KEYS:
                self._store_failed()
            self.log.exception("task failed", op=op, task_id=task_id)
            return reply(op, Status.FAILED, task_id, {"message": f"{type(exc).__name__}: {exc}"})

    def _store_failed(self) -> None:
        """Count a store task that failed, in status by the time its client has the reply."""
        self.store_failures += 1
        self._mirror_store_counters()

    def _hello(self, client: Client, task_id: int, payload: bytes) -> bytes:
        try:
            theirs = json.loads(payload).get("generation")
        except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested past the stack
            raise InvalidTask("hello", "payload must be a JSON object with the generation") from None
        ours = f"{self.generation:016x}"
        if theirs != ours:
            client.greeted = False  # a client that expects another daemon sends nothing more to this one
            raise InvalidTask("generation", f"client expects generation {theirs}, this daemon is {ours}")
        client.greeted = True
        spec = self.engine.spec
        body = {
            "rank": self.rank,
            "generation": ours,
            "num_blocks": spec.num_blocks,
            "num_cpu_blocks": spec.num_cpu_blocks,
            "block_bytes": spec.block_bytes,
        }
        return reply(Op.HELLO, Status.OK, task_id, body)

    def _swap(self, op: Op, flags: int, task_id: int, payload: bytes) -> bytes:
        keys: list[bytes] = []
        if op is Op.SWAP_OUT and flags & FLAG_KEYS:
            keyed = unpack_keyed(payload, 2)
            if keyed is None:
                raise InvalidTask("payload", f"{len(payload)} bytes is not n device ids, n CPU ids and n keys")
            (src, dst), keys = keyed
        else:
            ids = unpack_ids(payload)
            if ids is None:
                raise InvalidTask("payload", f"{len(payload)} bytes is not two equal lists of int32 block ids")
            src, dst = ids
        out = op is Op.SWAP_OUT
        tiers = ("device", "cpu") if out else ("cpu", "device")
        self.engine.validate(src, dst, src_tier=tiers[0], dst_tier=tiers[1])
        if keys and self.store is not None:  # write-through, store first: if it fails, the pool has not changed
            self._put_blocks(src, keys)
        started = time.monotonic_ns()
        if out and self.keys is not None:
            self.keys.forget(dst.tolist())  # before a byte of them changes (see kvcached.daemon.keydir)
        moved = self.engine.swap_out(src, dst) if out else self.engine.swap_in(src, dst)
        if keys and self.keys is not None:
            self.keys.publish(dst.tolist(), keys)
        took = time.monotonic_ns() - started
        self.stats.count_task("swap_out" if out else "swap_in", len(src), moved, took)
        return reply(op, Status.OK, task_id, TASK_RESULT.pack(len(src), moved, took))

    def _require_store(self) -> StoreCalls:
        store = self.store
        if store is None:
            raise InvalidTask(
                "storage_backend", "this instance has no attention store (start it with --storage-backend)"
            )
        return store

    def _put_blocks(self, device_ids: Array, keys: list[bytes]) -> int:
        """Store device blocks under ``keys``: in one call straight from the blocks (``direct``), else a
        staging buffer at a time; bytes newly written."""
        store = self._require_store()
        staging = store.staging
        started = time.monotonic_ns()
        written = 0
        store.call("protect", keys)
        try:
            if store.direct:
                written = store.call("put_blocks", keys, device_ids.tolist())
            else:
                for start in range(0, len(keys), len(staging)):
                    chunk = device_ids[start : start + len(staging)]
                    self.engine.copy_out(chunk, np.arange(len(chunk)), staging)
                    written += store.call("put_many", keys[start : start + len(chunk)])
        finally:
            with contextlib.suppress(StoreUnavailable):
                store.call("protect", [])
            self._mirror_store_counters()
        nbytes = written * self.engine.spec.block_bytes
        self.stats.count_task("store", len(keys), nbytes, time.monotonic_ns() - started)
        return nbytes

    def _store_task(self, op: Op, task_id: int, payload: bytes, client: Client) -> bytes:
        started = time.monotonic_ns()
        if op is Op.LOOKUP:
            if len(payload) % KEY_BYTES:
                raise InvalidTask("keys", f"{len(payload)} bytes is not a list of {KEY_BYTES}-byte keys")
            self._require_keyed_tier()
            keys = [payload[i : i + KEY_BYTES] for i in range(0, len(payload), KEY_BYTES)]
            found = self._host_prefix(keys)
            self.stats.count(lookup_tasks=1)
            return reply(op, Status.OK, task_id, TASK_RESULT.pack(found, 0, time.monotonic_ns() - started))
        keyed = unpack_keyed(payload, 1)
        if keyed is None:
            raise InvalidTask("payload", f"{len(payload)} bytes is not n device block ids and n keys")
        (ids,), keys = keyed
        if op is Op.STORE:
            self._require_store()
            self.engine.check_ids(ids, field="device_block_ids", role="source", unique=False)
            nbytes = self._put_blocks(ids, keys)
            return reply(op, Status.OK, task_id, TASK_RESULT.pack(len(keys), nbytes, time.monotonic_ns() - started))
        self._require_keyed_tier()
        self.engine.check_ids(ids, field="device_block_ids", role="target", unique=True)
        loaded = self._host_prefix(keys, ids, _next_load(client))
        nbytes = loaded * self.engine.spec.block_bytes
        took = time.monotonic_ns() - started
        self.stats.count_task("load", loaded, nbytes, took)
        return reply(op, Status.OK, task_id, TASK_RESULT.pack(loaded, nbytes, took))

    def _require_keyed_tier(self) -> None:
        if self.store is None and self.keys is None:
            raise InvalidTask(
                "storage_backend",
                "this instance has neither a CPU pool nor an attention store to find keys in "
                "(start it with --num-cpu-blocks > 0 or --storage-backend)",
            )

    def _host_prefix(self, keys: list[bytes], targets: Array | None = None, ahead: list[bytes] | None = None) -> int:
        """How many leading ``keys`` a host tier holds, taken in runs the CPU pool (its key directory) holds all or none
        of, each key looked up once; with device blocks ``targets``, load them there, each from the fastest tier with it
        (CPU pool, else store); ``ahead`` (``Store.expect``): the keys of its client's next load."""
        found = (self.keys.find(key) if self.keys is not None else None for key in keys)
        done = end = 0
        for in_store, run in itertools.groupby(found, key=lambda block: block is None):
            blocks = list(run)
            start, end = end, end + len(blocks)
            if not in_store:
                if targets is not None:
                    self.engine.swap_in(np.array(blocks, dtype=np.int64), targets[start:end])
                done += len(blocks)
            elif self.store is None:
                break
            elif targets is None:
                done += self.store.call("present", keys[start:end])
            else:
                done += self._load_from_store(keys[start:end], targets[start:end], self.store, ahead or [])
            if done < end:
                break
        return done

    def _load_from_store(self, keys: list[bytes], targets: Array, store: StoreCalls, ahead: list[bytes]) -> int:
        """Load the longest present prefix of ``keys`` from the store into device blocks ``targets``: in one
        call straight into the blocks (``direct``), else a staging buffer at a time (the store agent fills
        staging rows; this process copies them into the device tier)."""
        if store.direct:
            loaded: int = store.call("load_blocks", keys, targets.tolist(), ahead)
            return loaded
        staging = store.staging
        loaded = 0
        for start in range(0, len(keys), len(staging)):
            chunk = keys[start : start + len(staging)]
            got = store.call("load_prefix", chunk)
            self.engine.copy_in(np.arange(got), targets[start : start + got], staging)
            loaded += got
            if got < len(chunk):  # stops at the first miss: a block without its prefix is of no use
                break
        return loaded

    def maintain(self) -> None:
        """Between tasks: let the store look for trouble, and show its figures (``kvcached status``)."""
        if self.store is not None:
            self.store.maintain()
            self._mirror_store_counters()

    def _mirror_store_counters(self) -> None:
        if self.store is None:
            return
        c = self.store.counters
        self.stats.set(
            store_errors=self.store_failures + c.errors,
            store_objects=c.objects,
            store_bytes_used=c.bytes,
            store_hits=c.hits,
            store_misses=c.misses,
            store_evictions=c.evictions,
            store_corrupt=c.corrupt,
            store_master_resets=c.master_resets,
            store_unavailable=int(self.store.unavailable),
            **{f"store_{name}": getattr(c, name) for name in REPUBLISH_COUNTERS},
        )
        self._log_republish(c)
        if self.store.unavailable != self.store_was_unavailable and self.store.opened:
            self.store_was_unavailable = self.store.unavailable
            if self.store_was_unavailable:
                self.log.warning(
                    "attention store unavailable: store tasks fail until it answers", backend=self.store.name
                )
            else:
                self.log.info("attention store available again", backend=self.store.name)

    def _log_republish(self, c: StoreCounters) -> None:
        """Say when the store starts putting back this rank's objects its index forgot, and when it is done."""
        if c.republish_pending and not self.republishing:
            self.log.warning(
                "the store's master forgot this rank's objects: they are being put back",
                objects=c.republish_pending,
                bytes=c.republish_pending_bytes,
            )
        elif self.republishing and not c.republish_pending:
            self.log.info(
                "the objects the store's master forgot are back",
                done=c.republish_done,
                skipped=c.republish_skipped,
                failed=c.republish_failed,
                rate=c.republish_rate,
            )
        self.republishing = bool(c.republish_pending)


def _next_load(client: Client) -> list[bytes]:
    """The first ``AHEAD_KEYS`` keys of the load ``client`` has sent after the one being run, when it is
    buffered already (else none): the store may start finding them while this one lands. Only those keys
    are copied out of the buffer; the request itself is checked when it runs."""
    found = client.next_request()
    if found is None or found[0] != Op.LOAD or found[1] % (4 + KEY_BYTES):
        return []
    count = found[1] // (4 + KEY_BYTES)
    start = PAYLOAD_AT + 4 * count
    raw = bytes(client.inbuf[start : start + min(count, AHEAD_KEYS) * KEY_BYTES])
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
