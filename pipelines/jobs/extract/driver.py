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
import os
import time
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
)
from pipelines.jobs.extract.plan import DECODE_CPUS, plan_resources
from pipelines.jobs.extract.pool import Job, Slot, await_replicas, units
from pipelines.jobs.image_inputs import InputError, unique_ids
from pipelines.jobs.ray_runtime import init_ray

log = logging.getLogger(__name__)

__all__ = ["ExtractConfig", "ExtractSummary", "JobError", "errors_path", "run_extract", "summary_path"]


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
        meta = reader.meta
        old_settings = meta.get("provenance", {}).get("extract_settings")
        already = sum(1 for i in ids if i in reader)
        reader.close()
        check_same_settings(out, old_settings, recorded_settings(cfg, None))
        check_store_fits(out, meta, cfg)
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
        replica_cls = ray.remote(Replica).options(num_cpus=plan.cpus, num_gpus=plan.gpus, max_restarts=0)
        decoder_cls = ray.remote(Decoder).options(num_cpus=DECODE_CPUS, max_restarts=0)
        slots = [
            Slot(replica_cls, decoder_cls, build, plan.threads, cfg.decode_timeout)
            for _ in range(plan.workers)
        ]
        try:
            infos = await_replicas(slots, plan, cfg.startup_timeout)
        except ray.exceptions.RayActorError as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise InputError(f"the detector replicas could not start: {lines[-1] if lines else exc}") from exc
        provenance = dict(infos[0]["provenance"])
        provenance["extract_settings"] = recorded_settings(cfg, provenance)
        check_same_settings(out, old_settings, provenance["extract_settings"])
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
            max_boxes=provenance["max_boxes"],  # the grid's cell count for grid features
            dtype=cfg.dtype,
            meta=provenance,
        )
        try:
            job = Job(cfg, writer, slots, total - already)
            t_work = time.perf_counter()
            job.run(units(cfg, writer))
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


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
