"""The Ray extraction job: image folders -> detector replicas -> one LMDB writer (or, with --shards
per-replica, one shard per replica that each replica writes itself), resumable.

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
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import ray

from pipelines.jobs.extract.actors import Decoder, Replica
from pipelines.jobs.extract.config import (
    ExtractConfig,
    ExtractSummary,
    JobError,
    build_kwargs,
    check_same_settings,
    check_store_fits,
    check_weights,
    errors_path,
    recorded_settings,
    summary_path,
    working_size,
)
from pipelines.jobs.extract.plan import DECODE_CPUS, plan_resources
from pipelines.jobs.extract.pool import Job, Slot, await_replicas, units
from pipelines.jobs.extract.sinks import ShardSink, StoreSink
from pipelines.jobs.image_inputs import InputError, unique_ids
from pipelines.jobs.ray_runtime import init_ray

log = logging.getLogger(__name__)

__all__ = ["ExtractConfig", "ExtractSummary", "JobError", "errors_path", "run_extract", "summary_path"]


def run_extract(cfg: ExtractConfig, replica: type = Replica) -> ExtractSummary:
    """Extract every image of `cfg.inputs` not yet in `cfg.out`; write errors and summary beside it.

    `replica`: the detector actor's class (a subclass may build another detector, as benchmarks do)."""
    from storage import FeatureWriter
    from storage.shards import shard_path, write_manifest

    t_start = time.perf_counter()
    out = Path(cfg.out)
    sharded = cfg.shards == "per-replica"
    ids = unique_ids(cfg.inputs, cfg.recursive, cfg.id_from)
    if cfg.only_ids is not None:
        ids &= set(cfg.only_ids)
    total = len(ids)
    previous, stored, job_token = _existing(out, cfg, ids)
    already = len(stored)
    del ids
    local = cfg.address is None and not os.environ.get("RAY_ADDRESS")
    if local and cfg.weights is not None:
        # read once here (a second or two) so that a bad file is one line, not a replica failure under Ray
        check_weights(cfg.weights)

    session = init_ray(cfg.address, include_dashboard=cfg.include_dashboard)
    slots: list[Slot] = []
    try:
        plan = plan_resources(cfg, local)
        build = build_kwargs(cfg, plan.device)
        replica_cls = ray.remote(replica).options(num_cpus=plan.cpus, num_gpus=plan.gpus, max_restarts=0)
        decoder_cls = ray.remote(Decoder).options(num_cpus=DECODE_CPUS, max_restarts=0)
        root = out.resolve()  # the replicas' working directory is not ours
        slots = [
            Slot(
                replica_cls,
                decoder_cls,
                build,
                plan.threads,
                cfg.decode_timeout,
                {"working": working_size(cfg), "threads": plan.decode_threads},
                **({"shard": str(shard_path(root, i)), "cfg": cfg, "job": job_token} if sharded else {}),
            )
            for i in range(plan.workers)
        ]
        try:
            infos = await_replicas(slots, plan, cfg.startup_timeout)
        except ray.exceptions.RayActorError as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise InputError(f"the detector replicas could not start: {lines[-1] if lines else exc}") from exc
        provenance = dict(infos[0]["provenance"])
        provenance["extract_settings"] = recorded_settings(cfg, provenance)
        for path, settings in previous:
            check_same_settings(path, settings, provenance["extract_settings"])
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
        writer = None
        if sharded:
            write_manifest(out, provenance, job_token)
            sink = ShardSink(root)
            unit_size = cfg.batch_size * cfg.unit_batches
        else:
            writer = FeatureWriter(
                out,
                feature_dim=infos[0]["feature_dim"],
                max_boxes=provenance["max_boxes"],  # the grid's cell count for grid features
                dtype=cfg.dtype,
                meta=provenance,
            )
            sink = StoreSink(writer)
            stored = writer
            unit_size = cfg.batch_size
        try:
            job = Job(cfg, sink, slots, total - already)
            t_work = time.perf_counter()
            cpu_work = time.process_time()
            job.run(units(cfg, stored, unit_size))
            work_s = max(time.perf_counter() - t_work, 1e-9)
            driver_cpu_s = time.process_time() - cpu_work
        finally:
            if writer is not None:
                writer.close()
    finally:
        _close(slots)
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
        shards=cfg.shards,
        driver_cpu_ms_per_image=round(1e3 * driver_cpu_s / max(job.done + job.failed, 1), 4),
    )
    _write_json(summary_path(out), asdict(summary))
    return summary


def _existing(
    out: Path, cfg: ExtractConfig, ids: set[str]
) -> tuple[list[tuple[Path, dict | None]], set[str], str]:
    """What `out` already holds: each store's path with the settings it was made with, and the ids of
    `ids` it holds; with shards also the token that makes this job the set's only writer. A store of the
    other layout, or of another shape or settings, is an InputError before Ray starts and before the
    set is claimed."""
    from storage import FeatureReader
    from storage.shards import claim, is_shard_set, read_manifest, shards_of

    sharded = cfg.shards == "per-replica"
    if sharded and (out / "data.mdb").is_file():
        raise InputError(
            f"{out} is a single store: write shards to a new --out, or resume it without --shards"
        )
    if not sharded and is_shard_set(out):
        raise InputError(
            f"{out} is a shard set (written with --shards per-replica): resume it with --shards "
            "per-replica, or `xmodal features merge` it into one store first"
        )
    if sharded and out.is_dir() and any(out.iterdir()) and not is_shard_set(out):
        raise InputError(f"{out} is a directory but not a shard set; choose a new or empty --out")
    if sharded:
        if is_shard_set(out):
            read_manifest(out)
        stores = shards_of(out)
    else:
        stores = [out] if (out / "data.mdb").is_file() else []
    previous = []
    for path in stores:
        reader = FeatureReader(path, lock=True)
        meta = reader.meta
        reader.close()
        settings = meta.get("provenance", {}).get("extract_settings")
        check_same_settings(path, settings, recorded_settings(cfg, None))
        check_store_fits(path, meta, cfg)
        previous.append((path, settings))
    token = ""
    if sharded:
        token = uuid.uuid4().hex
        claim(out, token)  # a killed job's replicas cannot commit after the scan below
        stores = shards_of(out)
    stored: set[str] = set()
    for path in stores:
        reader = FeatureReader(path, lock=True)
        # ids only, never a record: a sharded job's skip set (a single store's writer answers for itself)
        stored.update(i for i in reader if i in ids)
        reader.close()
    return previous, stored, token


def _close(slots: list[Slot]) -> None:
    """Let replicas close their shards (each call ended with a commit: nothing is lost if they cannot),
    then end every actor."""
    live = [s for s in slots if not s.retired]
    if live:
        ray.wait([s.handle.close.remote() for s in live], num_returns=len(live), timeout=30)
    for slot in slots:
        slot.kill()


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
