"""The replica pool and its driver loop: batches in flight per replica (backpressure), results handed to
the sink as they arrive, dead replicas restarted or retired, failed images retried alone and then
recorded."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque
from collections.abc import Container, Iterator
from dataclasses import dataclass, field

import ray

from pipelines.jobs.extract.actors import first_line
from pipelines.jobs.extract.config import ExtractConfig, JobError, errors_path
from pipelines.jobs.extract.plan import Plan, cluster_state, requested
from pipelines.jobs.image_inputs import ImageInput, iter_images

log = logging.getLogger(__name__)


DEPTH = 2  # batches in flight per replica: one detecting, one decoded and queued behind it


STARTUP_WARN_S = 60.0  # how often to say that the replicas are still waiting to be placed


MAX_LOGGED_FAILURES = 20


@dataclass
class Unit:
    """A batch of images to decode and detect, how many times it was tried, and the slots it killed."""

    items: list[ImageInput]
    attempts: int = 0
    died_on: set[Slot] = field(default_factory=set)


class Slot:
    """A replica, its decoder and the batches they have in flight; replaced by fresh ones on a death."""

    def __init__(
        self,
        replica_cls,
        decoder_cls,
        build: dict,
        threads: int,
        decode_timeout: float,
        decoder_options: dict | None = None,
        **replica_options,
    ) -> None:
        """`decoder_options`: the decoder's other arguments (the detector's working size to resize to,
        its threads)."""
        self._make = lambda: (
            replica_cls.remote(build, threads, **replica_options),
            decoder_cls.remote(decode_timeout, **(decoder_options or {})),
        )
        self.handle, self.decoder = self._make()
        self.inflight: dict[ray.ObjectRef, Unit] = {}
        self.deaths = 0  # deaths since this slot last finished a batch
        self.retired = False

    def submit(self, unit: Unit) -> ray.ObjectRef:
        unit.attempts += 1
        ref = self.handle.detect.remote(self.decoder.decode.remote(unit.items))
        self.inflight[ref] = unit
        return ref

    def kill(self) -> None:
        ray.kill(self.handle)
        ray.kill(self.decoder)

    def restart(self) -> None:
        """Replace replica and decoder (either may be the one that died); their batches are the caller's."""
        self.kill()
        self.handle, self.decoder = self._make()
        self.inflight.clear()

    def retire(self) -> None:
        """Kill replica and decoder for good; their batches are the caller's."""
        self.kill()
        self.inflight.clear()
        self.retired = True

    def rank(self, unit: Unit) -> tuple[bool, bool]:
        """Lower is a better place to retry `unit`: a slot it has not killed, then one not dying lately."""
        return self in unit.died_on, self.deaths > 0


class Job:
    """The driver loop: keeps replicas fed, hands results to the sink (pipelines.jobs.extract.sinks) as
    they come, records failures."""

    def __init__(self, cfg: ExtractConfig, sink, slots: list[Slot], todo: int) -> None:
        from tqdm import tqdm

        self.cfg = cfg
        self.sink = sink
        self.slots = slots
        self.done = 0
        self.failed = 0
        self.restarts = 0
        # Each death charges one attempt to the one batch its actor died on, and a charged batch comes
        # back as single images that are given up after `max_attempts`: so even if every batch in flight
        # at once (workers x DEPTH of them, batch_size images each) were entirely poisonous and all their
        # retries landed on one slot, they could not kill it more than max_attempts x batch_size x workers
        # x DEPTH times before it finishes a batch of its own; one more allows for its node going away.
        # A longer run is that replica failing (out of memory, a broken GPU or node): it is retired, and
        # the job stops only when no replica is left, rather than fail every image one restart at a time.
        self.restart_limit = cfg.max_attempts * cfg.batch_size * len(slots) * DEPTH + 1
        self.retry: deque[Unit] = deque()
        self.paths: dict[str, str] = {}
        self.errors_file = errors_path(cfg.out)
        self.errors = None
        self.bar = tqdm(
            total=todo,
            unit="img",
            desc="extract",
            disable=not cfg.progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def run(self, units: Iterator[Unit]) -> None:
        # truncated: the file lists this run's failures, and every earlier failure is retried by this run
        with open(self.errors_file, "w", encoding="utf-8") as self.errors, self.bar:
            self._loop(units)

    def _loop(self, units: Iterator[Unit]) -> None:
        owner: dict[ray.ObjectRef, Slot] = {}
        last_commit = time.monotonic()
        while True:
            live = [s for s in self.slots if not s.retired]
            for slot in sorted(live, key=lambda s: len(s.inflight)):
                while len(slot.inflight) < DEPTH:
                    unit = self._next_unit(slot, live, units)
                    if unit is None:
                        break
                    self.paths.update((i.img_id, i.path) for i in unit.items)
                    owner[slot.submit(unit)] = slot
            if not owner:
                break
            ready, _ = ray.wait(list(owner), num_returns=1, timeout=1.0)
            for ref in ready:
                slot = owner.pop(ref, None)
                if slot is not None and ref in slot.inflight:
                    self._collect(ref, slot, owner)
            if time.monotonic() - last_commit >= self.cfg.commit_seconds:
                self.sink.flush()
                last_commit = time.monotonic()

    def _next_unit(self, slot: Slot, live: list[Slot], units: Iterator[Unit]) -> Unit | None:
        """The first retry that `slot` is among the best places for, else the listing's next batch.

        A retry waits for a better slot even when this one is free: given to the replica that just died on
        it (the first one free after a restart), it would spend the attempts of good images on a broken
        replica.
        """
        for i, unit in enumerate(self.retry):
            if slot.rank(unit) == min(s.rank(unit) for s in live):
                del self.retry[i]
                return unit
        return next(units, None)

    def _collect(self, ref: ray.ObjectRef, slot: Slot, owner: dict) -> None:
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._replace(slot, owner, exc)
            return
        except ray.exceptions.RayError as exc:
            self._requeue(slot.inflight.pop(ref), first_line(exc))
            return
        self._store(slot.inflight.pop(ref), result, slot)

    def _replace(self, slot: Slot, owner: dict, exc: BaseException) -> None:
        """A replica or decoder died: keep what it finished, charge the batch it died on, retry the rest.

        Both actors run their calls one at a time in submission order, so the oldest batch whose call
        failed is the one being decoded or detected when the actor died; the batches behind it failed only
        because of that death and get their attempt back. Which failed result `ray.wait` hands over first
        is a race, so it does not decide whom to charge. A slot that dies more than `restart_limit` times
        without finishing a batch is retired instead of restarted.
        """
        reason = f"its replica or decoder died: {first_line(exc)}"
        failed: list[Unit] = []
        for ref, unit in list(slot.inflight.items()):
            owner.pop(ref, None)
            try:
                # resolves soon: the dead actor fails its calls, the live one finishes what it has
                result = ray.get(ref)
            except ray.exceptions.RayError:
                failed.append(unit)
                continue
            self._store(unit, result, slot)  # finished before the death
        # every call of the dead pair has come back: what its replica committed is final, and done
        failed = self._settle(slot, failed)
        culprit = failed[0] if failed else None
        lost = failed[1:]
        for unit in lost:
            unit.attempts -= 1
        self.restarts += 1
        slot.deaths += 1
        if slot.deaths > self.restart_limit:
            self._retire(slot, exc)
        else:
            log.warning(
                "a replica or its decoder died (%s); restarting both, retrying their images", first_line(exc)
            )
            slot.restart()
        if culprit is not None:
            culprit.died_on.add(slot)
            self._requeue(culprit, reason)
        self.retry.extend(lost)  # innocent and not charged: retried as they were

    def _retire(self, slot: Slot, exc: BaseException) -> None:
        """Stop using a slot that keeps dying whatever it is given; JobError when it was the last one."""
        slot.retire()
        left = sum(not s.retired for s in self.slots)
        cause = (
            f"replica {self.slots.index(slot)} died {slot.deaths} times in a row without finishing a batch "
            f"(last: {first_line(exc)}), more than bad images in the batches in flight could cause: the "
            "replica itself fails (out of memory? a broken GPU or node?)"
        )
        logs = "see the Ray logs (/tmp/ray/session_latest/logs on the nodes)"
        if not left:
            raise JobError(
                f"every replica was retired; the last: {cause}. Stopped; {logs}, then rerun the same "
                "command to resume"
            )
        log.warning("%s; retired it, going on with %d replica(s); %s", cause, left, logs)

    def _settle(self, slot: Slot, failed: list[Unit]) -> list[Unit]:
        """The failed batches less what the dead replica committed to its shard before dying.

        A batch it committed finished, so it is no culprit: its ids are counted done, and those it left
        out (images that failed, whose report the death lost) are retried uncharged, to be reported again.
        """
        held = self.sink.committed(self.slots.index(slot), [i.img_id for u in failed for i in u.items])
        if not held:
            return failed
        left = []
        for unit in failed:
            if not any(i.img_id in held for i in unit.items):
                left.append(unit)
                continue
            for item in unit.items:
                if item.img_id in held:
                    self.paths.pop(item.img_id, None)
            n = sum(1 for i in unit.items if i.img_id in held)
            self.done += n
            self.bar.update(n)
            unit.items = [i for i in unit.items if i.img_id not in held]
            if unit.items:
                unit.attempts -= 1
                self.retry.append(unit)
        return left

    def _store(self, unit: Unit, result: tuple[list, list[tuple[str, str]]], slot: Slot) -> None:
        slot.deaths = 0
        records, failures = result
        self.done += self.sink.take(records)
        self.bar.update(len(records))
        for img_id, reason in failures:
            self._fail(img_id, reason)
        for item in unit.items:
            self.paths.pop(item.img_id, None)

    def _requeue(self, unit: Unit, reason: str) -> None:
        """Retry a charged unit: a batch as single images, a single image until `max_attempts`."""
        if len(unit.items) > 1:
            # split so that one poisonous image cannot take its batch-mates down with it again
            self.retry.extend(
                Unit([item], attempts=unit.attempts, died_on=set(unit.died_on)) for item in unit.items
            )
        elif unit.attempts < self.cfg.max_attempts:
            self.retry.append(unit)
        else:
            self._fail(unit.items[0].img_id, f"gave up after {unit.attempts} attempts: {reason}")
            self.paths.pop(unit.items[0].img_id, None)

    def _fail(self, img_id: str, reason: str) -> None:
        path = self.paths.get(img_id, "")
        self.errors.write(json.dumps({"img_id": img_id, "path": path, "reason": reason}) + "\n")
        self.errors.flush()
        self.failed += 1
        self.bar.update(1)
        self.bar.set_postfix(failed=self.failed)
        if self.failed <= MAX_LOGGED_FAILURES:
            self.bar.write(f"{reason}; skipped, see {self.errors_file}", file=sys.stderr)
        elif self.failed == MAX_LOGGED_FAILURES + 1:
            self.bar.write(f"more failures are not shown; see {self.errors_file}", file=sys.stderr)


def units(cfg: ExtractConfig, stored: Container[str], size: int) -> Iterator[Unit]:
    """Units of `size` images not yet `stored`, read lazily from the listing."""
    batch: list[ImageInput] = []
    only = set(cfg.only_ids) if cfg.only_ids is not None else None
    for item in iter_images(cfg.inputs, cfg.recursive, cfg.id_from):
        if item.img_id in stored or (only is not None and item.img_id not in only):
            continue
        batch.append(item)
        if len(batch) == size:
            yield Unit(batch)
            batch = []
    if batch:
        yield Unit(batch)


def await_replicas(slots: list[Slot], plan: Plan, timeout: float) -> list[dict]:
    """Each replica's info once every replica and decoder has started; JobError after `timeout` seconds.

    A request the cluster cannot place (on a cluster the plan only warns, an autoscaler may add nodes)
    would otherwise leave `ray.get` waiting forever. A replica that fails to start raises at once.
    """
    infos = [s.handle.info.remote() for s in slots]
    pending = infos + [s.decoder.ready.remote() for s in slots]
    t0 = time.monotonic()
    next_warning = t0 + STARTUP_WARN_S
    while pending:
        now = time.monotonic()
        if now >= t0 + timeout:
            raise JobError(
                f"{len(pending)} of {2 * len(slots)} replicas and decoders were still not started after "
                f"{timeout:g}s (--startup-timeout): asked for {requested(plan)}; {cluster_state()}. "
                "Lower --workers, --cpus-per-worker or --gpus-per-worker, or add nodes"
            )
        wait_s = min(t0 + timeout, next_warning) - now
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(wait_s, 0.0))
        ray.get(ready)
        if not ready and time.monotonic() >= next_warning:
            log.warning(
                "still waiting after %.0fs for %d of %d replicas and decoders to start: asked for %s; %s",
                time.monotonic() - t0,
                len(pending),
                2 * len(slots),
                requested(plan),
                cluster_state(),
            )
            next_warning += STARTUP_WARN_S
    return ray.get(infos)
