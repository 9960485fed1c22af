"""How a daemon ends, by what it was asked (``kvcached.daemon.requests`` says what each signal asks; the supervisor's
``_cleanup`` picks the path; whether the memory stays: ``keeps``): a stop with every record STOPPING, the workers
stopped, then ``release_everything`` (the lock file last); the keep signal with every record KEPT, the workers stopped
after the requests clients already sent, then ``keep_for_next_start``; the restart signal as keep, but on a backend
whose memory outlives its workers (``host``) the workers go on serving, their channels handed to the image ``kvcached
start`` executes next (``kvcached.daemon.handover``)."""

from __future__ import annotations

from pathlib import Path

from kvcached import logs, store
from kvcached.config import DaemonConfig
from kvcached.daemon.ranks import RankSlot, remove_semaphores
from kvcached.daemon.reclaim import unlink_entries
from kvcached.memory.base import DeviceBackend, TierRequest
from kvcached.protocol.control import ControlBlock
from kvcached.protocol.names import instance_shm_entries


def keeps(slots: list[RankSlot], ranks: int, *, adopted: bool, keep: bool, stop: bool, log: logs.Logger) -> bool:
    """Whether the daemon ends keeping the memory: unless the operator says to release it (``stop`` without ``keep``),
    whenever every rank's memory is whole (``adopted``, or each slot's: published READY once), whatever it ends for
    (``keep``: a stop with --keep or a restart; neither: a rank that cannot be brought back, a failed start after
    adopting, a crash). Memory not yet whole is nothing to keep: released, and said so when it was asked to be kept."""
    whole = adopted or (len(slots) == ranks and all(slot.whole for slot in slots))
    if not whole:
        if keep:
            states = {slot.rank: slot.record.state.name for slot in slots if not slot.whole}
            log.warning("not keeping the memory: some ranks were never whole", states=states)
        return False
    if not keep and not stop:
        log.warning("keeping the memory for the next start: the daemon ends without being told to stop")
    return keep or not stop


def keep_for_next_start(
    block: ControlBlock | None, slots: list[RankSlot], *, generation: int, ranks: int, log: logs.Logger
) -> None:
    """The memory and the control block stay for the next start to adopt (a block still under its staging name never
    named the kept memory: it goes); the semaphores go, the next start makes its own."""
    if block is not None:
        if not block.installed:
            block.unlink()
        block.close()
    remove_semaphores(slot.sem for slot in slots)
    log.info("kept for the next start", generation=f"{generation:016x}", ranks=ranks)


def release_everything(
    block: ControlBlock | None,
    slots: list[RankSlot],
    *,
    config: DaemonConfig,
    backend: DeviceBackend,
    tiers: list[TierRequest],
    generations: tuple[int, int],
    log: logs.Logger,
) -> None:
    """A final stop: the control block, the semaphores, then, when the start got as far as a generation, the memory of
    every rank (``tiers``: each rank's, for its backend to release), every object of the instance named after one of
    ``generations`` (this start's, and the memory's arena id), and what the store keeps across runs."""
    if block is not None:
        block.unlink()
        block.close()
    remove_semaphores(slot.sem for slot in slots)
    if not generations[0]:
        return
    for request in tiers:
        backend.release(request)
    chosen = config.store  # it lets go of what it keeps across daemon runs (Mooncake keepers)
    if chosen.backend is not None:
        try:
            store.get(chosen.backend).release(chosen.options, instance=config.instance)
        except Exception as exc:  # a stop goes on: the keepers quit by themselves once the instance is gone
            log.warning("attention store: could not let go of what it keeps", reason=str(exc))
    # Arenas, pools, key directories, a semaphore or arena a killed worker half-made. Objects refused at start-up carry
    # neither name: they are not ours.
    names = {f".{generation:016x}." for generation in generations}
    unlink_entries([e for e in instance_shm_entries(config.instance) if any(n in e.name for n in names)])


def release_stores(instance: str, run_dir: Path, *, but: str | None = None) -> tuple[list[str], list[str]]:
    """Every storage backend but ``but`` lets go of what it keeps across daemon runs of ``instance`` (a Mooncake keeper
    left by a run that stored there, its socket and lock file): at a start whose configuration names another store, and
    at ``kvcached doctor --clean``. (The files of the run directory that went with it, what failed.)"""
    before = {path.name for path in run_dir.glob(f"{instance}.*")} if run_dir.is_dir() else set()
    problems = []
    for name in store.names():
        if name != but:
            try:
                store.get(name).release({}, instance=instance)
            except Exception as exc:  # a backend that cannot: said, and the rest goes on
                problems.append(f"{name}: {exc}")
    after = {path.name for path in run_dir.glob(f"{instance}.*")} if run_dir.is_dir() else set()
    return sorted(before - after), problems
