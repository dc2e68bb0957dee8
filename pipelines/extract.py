"""The Ray extraction job: image folders -> detector replicas -> one LMDB writer, resumable.

Design: a hand-rolled actor pool driven by `ray.wait`, rather than Ray Data's `map_batches`. The job
needs per-image bookkeeping that Ray Data hides: which images a dead replica had in flight (to retry
exactly those), how often an image has failed (to give up on it), and decode errors recorded without
failing a block. Backpressure is explicit: each replica has at most `DEPTH` batches in flight (one
running, one decoded and waiting), the listing is consumed lazily, and the driver writes each result as
it arrives, so memory stays bounded however many images there are; a pool of a few actors also starts
in a fraction of Ray Data's planning time, which matters for the overhead target.

Decoding runs on CPU in a small decoder actor paired with each replica, not in stateless tasks: a decode
worker imports torch (through `extraction`) on start, and Ray's idle-worker reaper would keep killing
and restarting task workers on a small node, paying that import again and again mid-run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

from pipelines.image_inputs import ImageInput, InputError, iter_images, unique_ids
from pipelines.ray_runtime import init_ray, local_cpu_count

log = logging.getLogger(__name__)

DEPTH = 2  # batches in flight per replica: one detecting, one decoded and queued behind it
DECODE_CPUS = 0.25  # the reservation of each replica's decoder
STARTUP_WARN_S = 60.0  # how often to say that the replicas are still waiting to be placed
MAX_LOGGED_FAILURES = 20
SETTINGS_KEYS = ("preset", "selection", "min_boxes", "max_boxes", "overrides", "weights_sha256")


@dataclass
class ExtractConfig:
    """Everything `xmodal extract` can be told; one place for the defaults."""

    inputs: list[str]
    out: str
    recursive: bool = False
    id_from: str = "stem"
    preset: str = "vg-r101-c4"
    weights: str | None = None
    selection: str = "caffe"
    min_boxes: int = 36
    max_boxes: int = 36
    overrides: dict = field(default_factory=dict)  # Detector.build overrides (min_size, max_size, ...)
    batch_size: int = 4
    workers: int | None = None  # None: one per GPU, else one CPU replica
    gpus_per_worker: float = 1.0
    cpus_per_worker: float | None = None  # None: 1 with GPUs, else the CPUs left after decoding, shared
    address: str | None = None
    max_failures: int = 0
    max_attempts: int = 3  # tries per image (a batch, then alone) before it is recorded as failed
    startup_timeout: float = 600.0  # seconds to wait for the replicas to be placed and built
    dtype: str = "float16"
    commit_seconds: float = 2.0  # commit at least this often, so a kill loses seconds of work
    progress: bool = True
    include_dashboard: bool = True


class JobError(RuntimeError):
    """The job cannot go on: its replicas cannot be placed, or keep dying whatever they are given."""


@dataclass
class ExtractSummary:
    store: str
    errors: str
    total: int
    done: int
    skipped: int
    failed: int
    images_per_s: float  # while extracting: from the first batch sent to the last result written
    elapsed_s: float  # the whole command, listing and Ray start-up included
    startup_s: float  # listing, Ray start-up and replicas built
    replicas: int
    restarts: int
    device: str
    exit_code: int


def errors_path(out: str | Path) -> Path:
    """`feats.lmdb` -> `feats.errors.jsonl`, beside the store."""
    return Path(out).with_suffix(".errors.jsonl")


def summary_path(out: str | Path) -> Path:
    """`feats.lmdb` -> `feats.summary.json`, beside the store."""
    return Path(out).with_suffix(".summary.json")


@dataclass
class _Unit:
    """A batch of images to decode and detect, how many times it was tried, and the slots it killed."""

    items: list[ImageInput]
    attempts: int = 0
    died_on: set[_Slot] = field(default_factory=set)


@dataclass
class _Plan:
    workers: int
    cpus: float
    gpus: float
    threads: int
    device: str


class _DecodedBatch:
    """Images decoded by a decoder, plus the ones that could not be."""

    def __init__(self, ids: list[str], images: list, failures: list[tuple[str, str]]) -> None:
        self.ids = ids
        self.images = images
        self.failures = failures


class _Decoder:
    """Reads and decodes the images of a batch on CPU; a bad file is reported, never raised."""

    def __init__(self) -> None:
        import extraction  # noqa: F401  (paid here, at start-up, not on the first batch)

    def ready(self) -> bool:
        return True

    def decode(self, items: list[ImageInput]) -> _DecodedBatch:
        return _decode(items)


def _decode(items: list[ImageInput]) -> _DecodedBatch:
    from extraction import load_image

    ids, images, failures = [], [], []
    for item in items:
        try:
            images.append(load_image(item.path))
            ids.append(item.img_id)
        except Exception as exc:  # any decoder failure is this file's problem, recorded, never the job's
            failures.append((item.img_id, _reason(exc)))
    return _DecodedBatch(ids, images, failures)


class _Replica:
    """One detector model; `detect` never raises for a bad image, it reports it."""

    def __init__(self, build: dict, threads: int) -> None:
        import torch

        from extraction import Detector

        torch.set_num_threads(threads)
        self.det = Detector.build(**build)

    def info(self) -> dict:
        return {"provenance": self.det.provenance(), "feature_dim": int(self.det.feature_dim)}

    def detect(self, batch: _DecodedBatch) -> tuple[list, list[tuple[str, str]]]:
        failures = list(batch.failures)
        if not batch.images:
            return [], failures
        try:
            return self.det.detect(batch.images, batch.ids), failures
        except Exception:  # isolate the image that broke the batch instead of failing all of it
            records = []
            for img_id, image in zip(batch.ids, batch.images, strict=True):
                try:
                    records.extend(self.det.detect([image], [img_id]))
                except Exception as exc:
                    failures.append((img_id, f"detection failed: {_reason(exc)}"))
            return records, failures


def run_extract(cfg: ExtractConfig) -> ExtractSummary:
    """Extract every image of `cfg.inputs` not yet in `cfg.out`; write errors and summary beside it."""
    from storage import FeatureReader, FeatureWriter

    t_start = time.perf_counter()
    out = Path(cfg.out)
    ids = unique_ids(cfg.inputs, cfg.recursive, cfg.id_from)
    total = len(ids)
    old_settings = None
    already = 0
    if (out / "data.mdb").is_file():
        reader = FeatureReader(out, lock=True)
        old_settings = reader.meta.get("provenance", {}).get("extract_settings")
        already = sum(1 for i in ids if i in reader)
        reader.close()
        _check_same_settings(out, old_settings, _settings(cfg, None))
    del ids
    local = cfg.address is None and not os.environ.get("RAY_ADDRESS")
    if local and cfg.weights is not None and not Path(cfg.weights).is_file():
        raise InputError(f"--weights {cfg.weights} is not a file (see `xmodal convert detector`)")

    session = init_ray(cfg.address, include_dashboard=cfg.include_dashboard)
    slots: list[_Slot] = []
    try:
        plan = _plan_resources(cfg, local)
        build = _build_kwargs(cfg, plan.device)
        replica_cls = ray.remote(_Replica).options(num_cpus=plan.cpus, num_gpus=plan.gpus, max_restarts=0)
        decoder_cls = ray.remote(_Decoder).options(num_cpus=DECODE_CPUS, max_restarts=0)
        slots = [_Slot(replica_cls, decoder_cls, build, plan.threads) for _ in range(plan.workers)]
        try:
            infos = _await_replicas(slots, plan, cfg.startup_timeout)
        except ray.exceptions.RayActorError as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise InputError(f"the detector replicas could not start: {lines[-1] if lines else exc}") from exc
        provenance = dict(infos[0]["provenance"])
        provenance["extract_settings"] = _settings(cfg, provenance)
        _check_same_settings(out, old_settings, provenance["extract_settings"])
        startup = time.perf_counter() - t_start
        log.info(
            "%d %s replica(s) ready in %.1fs (%g CPU, %g GPU each); %d images, %d already in %s",
            plan.workers,
            plan.device,
            startup,
            plan.cpus,
            plan.gpus,
            total,
            already,
            out,
        )
        writer = FeatureWriter(
            out,
            feature_dim=infos[0]["feature_dim"],
            max_boxes=cfg.max_boxes,
            dtype=cfg.dtype,
            meta=provenance,
        )
        try:
            job = _Job(cfg, writer, slots, total - already)
            t_work = time.perf_counter()
            job.run(_units(cfg, writer))
            work_s = max(time.perf_counter() - t_work, 1e-9)
        finally:
            writer.close()
    finally:
        for slot in slots:
            slot.kill()
        session.close()
    elapsed = time.perf_counter() - t_start
    summary = ExtractSummary(
        store=str(out),
        errors=str(errors_path(out)),
        total=total,
        done=job.done,
        skipped=total - job.done - job.failed,
        failed=job.failed,
        images_per_s=round(job.done / work_s, 3),
        elapsed_s=round(elapsed, 3),
        startup_s=round(startup, 3),
        replicas=plan.workers,
        restarts=job.restarts,
        device=plan.device,
        exit_code=2 if job.failed > cfg.max_failures else 0,
    )
    _write_json(summary_path(out), asdict(summary))
    return summary


class _Slot:
    """A replica, its decoder and the batches they have in flight; replaced by fresh ones on a death."""

    def __init__(self, replica_cls, decoder_cls, build: dict, threads: int) -> None:
        self._make = lambda: (replica_cls.remote(build, threads), decoder_cls.remote())
        self.handle, self.decoder = self._make()
        self.inflight: dict[ray.ObjectRef, _Unit] = {}
        self.deaths = 0  # deaths since this slot last finished a batch
        self.retired = False

    def submit(self, unit: _Unit) -> ray.ObjectRef:
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

    def rank(self, unit: _Unit) -> tuple[bool, bool]:
        """Lower is a better place to retry `unit`: a slot it has not killed, then one not dying lately."""
        return self in unit.died_on, self.deaths > 0


class _Job:
    """The driver loop: keeps replicas fed, writes results as they come, records failures."""

    def __init__(self, cfg: ExtractConfig, writer, slots: list[_Slot], todo: int) -> None:
        from tqdm import tqdm

        self.cfg = cfg
        self.writer = writer
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
        self.retry: deque[_Unit] = deque()
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

    def run(self, units: Iterator[_Unit]) -> None:
        # truncated: the file lists this run's failures, and every earlier failure is retried by this run
        with open(self.errors_file, "w", encoding="utf-8") as self.errors, self.bar:
            self._loop(units)

    def _loop(self, units: Iterator[_Unit]) -> None:
        owner: dict[ray.ObjectRef, _Slot] = {}
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
                self.writer.flush()
                last_commit = time.monotonic()

    def _next_unit(self, slot: _Slot, live: list[_Slot], units: Iterator[_Unit]) -> _Unit | None:
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

    def _collect(self, ref: ray.ObjectRef, slot: _Slot, owner: dict) -> None:
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._replace(slot, owner, exc)
            return
        except ray.exceptions.RayError as exc:
            self._requeue(slot.inflight.pop(ref), _first_line(exc))
            return
        self._store(slot.inflight.pop(ref), result, slot)

    def _replace(self, slot: _Slot, owner: dict, exc: BaseException) -> None:
        """A replica or decoder died: keep what it finished, charge the batch it died on, retry the rest.

        Both actors run their calls one at a time in submission order, so the oldest batch whose call
        failed is the one being decoded or detected when the actor died; the batches behind it failed only
        because of that death and get their attempt back. Which failed result `ray.wait` hands over first
        is a race, so it does not decide whom to charge. A slot that dies more than `restart_limit` times
        without finishing a batch is retired instead of restarted.
        """
        reason = f"its replica or decoder died: {_first_line(exc)}"
        culprit: _Unit | None = None
        lost: list[_Unit] = []
        for ref, unit in list(slot.inflight.items()):
            owner.pop(ref, None)
            try:
                # resolves soon: the dead actor fails its calls, the live one finishes what it has
                result = ray.get(ref)
            except ray.exceptions.RayError:
                if culprit is None:
                    culprit = unit
                else:
                    unit.attempts -= 1
                    lost.append(unit)
                continue
            self._store(unit, result, slot)  # finished before the death
        self.restarts += 1
        slot.deaths += 1
        if slot.deaths > self.restart_limit:
            self._retire(slot, exc)
        else:
            log.warning(
                "a replica or its decoder died (%s); restarting both, retrying their images", _first_line(exc)
            )
            slot.restart()
        if culprit is not None:
            culprit.died_on.add(slot)
            self._requeue(culprit, reason)
        self.retry.extend(lost)  # innocent and not charged: retried as they were

    def _retire(self, slot: _Slot, exc: BaseException) -> None:
        """Stop using a slot that keeps dying whatever it is given; JobError when it was the last one."""
        slot.retire()
        left = sum(not s.retired for s in self.slots)
        cause = (
            f"replica {self.slots.index(slot)} died {slot.deaths} times in a row without finishing a batch "
            f"(last: {_first_line(exc)}), more than bad images in the batches in flight could cause: the "
            "replica itself fails (out of memory? a broken GPU or node?)"
        )
        logs = "see the Ray logs (/tmp/ray/session_latest/logs on the nodes)"
        if not left:
            raise JobError(
                f"every replica was retired; the last: {cause}. Stopped; {logs}, then rerun the same "
                "command to resume"
            )
        log.warning("%s; retired it, going on with %d replica(s); %s", cause, left, logs)

    def _store(self, unit: _Unit, result: tuple[list, list[tuple[str, str]]], slot: _Slot) -> None:
        slot.deaths = 0
        records, failures = result
        for rec in records:
            if self.writer.put(rec):
                self.done += 1
            self.bar.update(1)
        for img_id, reason in failures:
            self._fail(img_id, reason)
        for item in unit.items:
            self.paths.pop(item.img_id, None)

    def _requeue(self, unit: _Unit, reason: str) -> None:
        """Retry a charged unit: a batch as single images, a single image until `max_attempts`."""
        if len(unit.items) > 1:
            # split so that one poisonous image cannot take its batch-mates down with it again
            self.retry.extend(
                _Unit([item], attempts=unit.attempts, died_on=set(unit.died_on)) for item in unit.items
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


def _units(cfg: ExtractConfig, writer) -> Iterator[_Unit]:
    """Batches of images not yet in the store, read lazily from the listing."""
    batch: list[ImageInput] = []
    for item in iter_images(cfg.inputs, cfg.recursive, cfg.id_from):
        if item.img_id in writer:
            continue
        batch.append(item)
        if len(batch) == cfg.batch_size:
            yield _Unit(batch)
            batch = []
    if batch:
        yield _Unit(batch)


def _plan_resources(cfg: ExtractConfig, local: bool) -> _Plan:
    """Replica count and per-replica reservations that fit the cluster with room left for decoding.

    Every Ray actor reserves 1 CPU unless told otherwise; on a 2-core machine two such replicas would
    leave nothing for the decoders and the job would wait forever, so the reservations are computed
    (fractions allowed) and a request that cannot fit is refused up front. An actor lives on one node,
    so a reservation is also capped at what the largest node offers: on 2 nodes x 2 CPUs one replica
    gets 1.75 CPUs, not the 3.75 of the cluster's total that no node has.
    """
    resources = ray.cluster_resources()
    cpus = float(resources.get("CPU", local_cpu_count()))
    gpus = float(resources.get("GPU", 0))
    use_gpu = gpus > 0 and cfg.gpus_per_worker > 0
    node_cpus, node_gpus = _largest_node(cpus, gpus, cfg.gpus_per_worker if use_gpu else 0.0)
    largest = f"the largest node with {cfg.gpus_per_worker:g} GPU(s)" if use_gpu else "the largest node"
    if use_gpu:
        workers = cfg.workers or max(1, int(gpus // cfg.gpus_per_worker))
        per_cpu = cfg.cpus_per_worker if cfg.cpus_per_worker is not None else 1.0
        need_gpus = workers * cfg.gpus_per_worker
        if need_gpus > gpus:
            _refuse(
                f"{workers} replicas x {cfg.gpus_per_worker:g} GPU need {need_gpus:g} GPUs; "
                f"the cluster has {gpus:g}",
                local,
            )
        if cfg.gpus_per_worker > node_gpus:
            _refuse(
                f"a replica asks for {cfg.gpus_per_worker:g} GPUs but the largest node has {node_gpus:g}; "
                "lower --gpus-per-worker",
                local,
            )
    else:
        workers = cfg.workers or 1
        per_cpu = cfg.cpus_per_worker
        if per_cpu is None:
            share = min(cpus / workers, node_cpus) - DECODE_CPUS
            per_cpu = math.floor(share * 100) / 100
            if per_cpu <= 0:
                _refuse(f"{workers} CPU replicas do not fit in {cpus:g} CPUs; lower --workers", True)
    if workers * (per_cpu + DECODE_CPUS) > cpus + 1e-9:
        _refuse(
            f"{workers} replicas x ({per_cpu:g} CPUs + {DECODE_CPUS} for decoding) exceed the cluster's "
            f"{cpus:g} CPUs, so the job would wait forever; lower --workers or --cpus-per-worker "
            "(fractions allowed)",
            local,
        )
    if per_cpu > node_cpus + 1e-9:
        _refuse(
            f"a replica asks for {per_cpu:g} CPUs but {largest} has {node_cpus:g}, so it would "
            "wait forever; lower --cpus-per-worker (fractions allowed)",
            local,
        )
    threads = max(1, round(per_cpu))
    return _Plan(
        workers, per_cpu, cfg.gpus_per_worker if use_gpu else 0.0, threads, "cuda" if use_gpu else "cpu"
    )


def _alive_node_resources() -> list[dict]:
    return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]


def _largest_node(cpus: float, gpus: float, gpus_per_worker: float) -> tuple[float, float]:
    """The most CPUs of an alive node that has `gpus_per_worker` GPUs, and the most GPUs of any.

    A replica needs both on one node: the CPUs of a head node without GPUs are no use to a GPU replica.
    Falls back to every node's CPUs when none has the GPUs (the GPU check refuses that), and to the
    cluster's totals when Ray lists no node.
    """
    alive = _alive_node_resources()
    if not alive:
        return cpus, gpus
    hosts = [r for r in alive if float(r.get("GPU", 0)) >= gpus_per_worker - 1e-9] or alive
    return max(float(r.get("CPU", 0)) for r in hosts), max(float(r.get("GPU", 0)) for r in alive)


def _await_replicas(slots: list[_Slot], plan: _Plan, timeout: float) -> list[dict]:
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
                f"{timeout:g}s (--startup-timeout): asked for {_requested(plan)}; {_cluster_state()}. "
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
                _requested(plan),
                _cluster_state(),
            )
            next_warning += STARTUP_WARN_S
    return ray.get(infos)


def _requested(plan: _Plan) -> str:
    return (
        f"{plan.workers} replica(s) of {plan.cpus:g} CPU and {plan.gpus:g} GPU, "
        f"each with a {DECODE_CPUS:g} CPU decoder"
    )


def _cluster_state() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    alive = _alive_node_resources()
    nodes = ", ".join(f"{r.get('CPU', 0):g} CPU/{r.get('GPU', 0):g} GPU" for r in alive[:8])
    more = f" and {len(alive) - 8} more" if len(alive) > 8 else ""
    return (
        f"the cluster has {total.get('CPU', 0):g} CPU and {total.get('GPU', 0):g} GPU on {len(alive)} "
        f"node(s) ({nodes}{more}), {free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} GPU free now"
    )


def _refuse(message: str, local: bool) -> None:
    if local:
        raise InputError(message)
    log.warning("%s; waiting for the autoscaler to add nodes", message)


def _build_kwargs(cfg: ExtractConfig, device: str) -> dict:
    return dict(
        preset=cfg.preset,
        weights=cfg.weights,
        device=device,
        selection=cfg.selection,
        min_boxes=cfg.min_boxes,
        max_boxes=cfg.max_boxes,
        **cfg.overrides,
    )


def _settings(cfg: ExtractConfig, provenance: dict | None) -> dict:
    """What decides the features; a resumed store must have been made with the same.

    Without `provenance` (before any replica has hashed the weights) the checksum is left out.
    """
    settings = {
        "preset": cfg.preset,
        "selection": cfg.selection,
        "min_boxes": cfg.min_boxes,
        "max_boxes": cfg.max_boxes,
        "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(cfg.overrides.items())},
    }
    if provenance is not None:
        settings["weights_sha256"] = provenance.get("weights_sha256") or "random"
    return settings


def _check_same_settings(out: Path, old: dict | None, new: dict) -> None:
    if old is None:
        return
    changed = [k for k in SETTINGS_KEYS if k in new and old.get(k) != new[k]]
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise InputError(
            f"{out} was extracted with other settings ({detail}); resuming would mix features: "
            f"choose a new --out or the original settings"
        )


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _reason(exc: BaseException) -> str:
    from extraction import ImageError

    return str(exc) if isinstance(exc, ImageError) else f"{type(exc).__name__}: {exc}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
