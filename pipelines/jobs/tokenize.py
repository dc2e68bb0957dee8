"""Extract DALL-E token grids of image folders into an image-token store, by the extraction job's Ray pool
(decoder actors, dVAE replicas, retries, errors file, progress, resume): ids already stored are skipped,
unreadable images are recorded in NAME.errors.jsonl beside the store and skipped."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import ray

from pipelines.jobs.extract.actors import Decoder
from pipelines.jobs.extract.config import ExtractConfig, errors_path, summary_path
from pipelines.jobs.extract.plan import DECODE_CPUS, plan_resources
from pipelines.jobs.extract.pool import Job, Slot, await_replicas, units
from pipelines.jobs.image_inputs import InputError, unique_ids
from pipelines.jobs.ray_runtime import init_ray
from pipelines.jobs.tokenize_replica import TokenReplica, TokenSink

log = logging.getLogger(__name__)

TOKENIZE_ONLY = ("images", "tokenizer", "out")  # every other TokenizeConfig field is an ExtractConfig one


@dataclass
class TokenizeConfig:
    """Everything `xmodal generate tokenize` can be told; the job settings mean what `ExtractConfig`'s do."""

    images: list[str] = field(default_factory=list)  # image folders, list files or images
    tokenizer: str = ""  # a train-tokenizer run (its best/, else last/) or a dVAE directory
    out: str = ""  # the image-token store to create or resume
    recursive: bool = False
    id_from: str = "stem"
    batch_size: int = 64
    workers: int | None = None  # None: one per GPU, else one CPU replica
    gpus_per_worker: float = 1.0
    cpus_per_worker: float | None = None  # None: the CPUs left after decoding
    address: str | None = None
    max_failures: int = 0
    max_attempts: int = 3
    startup_timeout: float = 600.0
    decode_timeout: float = 60.0
    commit_seconds: float = 2.0
    progress: bool = True
    include_dashboard: bool = False

    def job_config(self) -> ExtractConfig:
        """The settings the extraction pool reads (listing, batching, resources, retries)."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in TOKENIZE_ONLY}
        return ExtractConfig(inputs=list(self.images), out=self.out, **shared)


@dataclass
class TokenizeSummary:
    store: str
    errors: str
    written: int
    skipped_present: int
    failed: int
    total: int
    images_per_s: float
    elapsed_s: float
    replicas: int
    restarts: int
    device: str
    exit_code: int  # 2 when more than max_failures images failed


def tokenizer_dir(path: str | Path) -> Path:
    """The dVAE directory of a tokenizer run (its best/, else last/) or the directory itself."""
    path = Path(path)
    for candidate in (path / "best", path / "last", path):
        if (candidate / "config.json").is_file():
            return candidate
    raise InputError(
        f"--tokenizer {path}: no dVAE here (no best/, last/ or config.json); give a train-tokenizer run"
    )


def weights_sha256(directory: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def run_tokenize(cfg: TokenizeConfig) -> TokenizeSummary:
    """Encode every image of `cfg.images` not yet in `cfg.out` with the dVAE of `cfg.tokenizer`."""
    from model.dalle import DiscreteVAE
    from storage.token_store import TokenWriter

    t_start = time.perf_counter()
    job_cfg = cfg.job_config()
    dvae_dir = tokenizer_dir(cfg.tokenizer)
    dvae = DiscreteVAE.from_pretrained(dvae_dir).config  # read here so a broken run is one line
    provenance = {
        "tokenizer": str(dvae_dir.resolve()),
        "tokenizer_sha256": weights_sha256(dvae_dir),
        "images": [str(Path(p).resolve()) for p in cfg.images],
    }
    total = len(unique_ids(cfg.images, cfg.recursive, cfg.id_from))
    out = Path(cfg.out)
    # opened before Ray starts: a store of another grid or tokenizer is one line at once
    writer = TokenWriter(out, dvae.grid_size, dvae.codebook_size, provenance)
    try:
        made_with = writer.meta["provenance"].get("tokenizer_sha256")
        if made_with not in (None, provenance["tokenizer_sha256"]):
            raise InputError(
                f"{out} was tokenized with another dVAE ({writer.meta['provenance'].get('tokenizer')}); "
                "resuming would mix codebooks: write to a new --out"
            )
        already = sum(1 for _ in _stored(writer, cfg))
        local = cfg.address is None and not os.environ.get("RAY_ADDRESS")
        session = init_ray(cfg.address, include_dashboard=cfg.include_dashboard)
        slots: list[Slot] = []
        try:
            plan = plan_resources(job_cfg, local)
            build = {"tokenizer": str(dvae_dir), "device": plan.device}
            replica_cls = ray.remote(TokenReplica).options(
                num_cpus=plan.cpus, num_gpus=plan.gpus, max_restarts=0
            )
            decoder_cls = ray.remote(Decoder).options(num_cpus=DECODE_CPUS, max_restarts=0)
            slots = [
                Slot(replica_cls, decoder_cls, build, plan.threads, cfg.decode_timeout)
                for _ in range(plan.workers)
            ]
            await_replicas(slots, plan, cfg.startup_timeout)
            log.info(
                "%d dVAE replica(s) on %s; %d images, %d already in %s",
                plan.workers,
                plan.device,
                total,
                already,
                out,
            )
            job = Job(job_cfg, TokenSink(writer), slots, total - already)
            t_work = time.perf_counter()
            job.run(units(job_cfg, writer, cfg.batch_size))
            work_s = max(time.perf_counter() - t_work, 1e-9)
        finally:
            for slot in slots:
                slot.kill()
            session.close()
    finally:
        writer.close()
    summary = TokenizeSummary(
        store=str(out),
        errors=str(errors_path(out)),
        written=job.done,
        skipped_present=total - job.done - job.failed,
        failed=job.failed,
        total=total,
        images_per_s=round(job.done / work_s, 3),
        elapsed_s=round(time.perf_counter() - t_start, 3),
        replicas=plan.workers,
        restarts=job.restarts,
        device=plan.device,
        exit_code=2 if job.failed > cfg.max_failures else 0,
    )
    path = summary_path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(summary), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return summary


def _stored(writer, cfg: TokenizeConfig):
    from pipelines.jobs.image_inputs import iter_images

    return (item for item in iter_images(cfg.images, cfg.recursive, cfg.id_from) if item.img_id in writer)
