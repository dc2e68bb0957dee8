"""`xmodal extract`: region (or grid) features for image folders, on this machine or a Ray cluster,
resumable."""

from __future__ import annotations

import argparse
import json
import logging
import shlex

from pipelines.commands.run_options import add_overrides_argument, config_default, split_overrides

log = logging.getLogger(__name__)

EPILOG = """\
inputs: image folders (files by suffix; --recursive descends), list files (.txt/.lst/.list: one path per
line, relative to the list's folder) or single images. Ids are file stems unless --id-from relpath;
duplicate ids stop the job before any work.

Resume is the default: ids already in --out are skipped, so rerun the same command after a crash.
--shards per-replica: --out is a directory holding shards.json (the job's one provenance record) and
shard-000/, shard-001/, ... (one store per replica, written by the replica itself; the driver hands out
work units and counts ids, never region bytes). Give a path every node sees (a shared filesystem). Every
command that reads features takes the directory as one store; `xmodal features merge DIR one.lmdb` makes
one file. An image is in exactly one shard whatever is killed; a rerun skips what any shard holds.
Beside the store: NAME.errors.jsonl (this run's failed images: img_id, path, reason) and
NAME.summary.json (total, done, skipped, failed, images_per_s, elapsed_s, ...), also printed.
Exit status: 0; 2 when more than --max-failures images failed (after finishing all others); 1 for
unusable input (missing path, duplicate or too long ids, settings that differ from the existing store's),
replicas the cluster cannot start within --startup-timeout, or replicas that keep dying.
--features grid writes grid features from the same detector instead of regions: stem -> res4 over the
whole image, res5 over the whole res4 map, pooled to --grid (14x14: Show, Attend and Tell's 196 cells;
native/2: the native stride-16 map pooled by 2, grid-feats-vqa's shape). A trailing @32 (14x14@32,
native/1@32) runs res5 at stride 32 as grid-feats-vqa extracts: exactly every other row and column of the
stride-16 map, for a quarter of res5's arithmetic; native/1@32 is grid-feats-vqa's grid. Each cell is a
record's box (in image pixels) with the box predictor's class and attributes, so every model reads the
store unchanged.
--config takes a YAML of ExtractConfig keys; flags win over it, and KEY=VALUE items (batch_size=8,
overrides.nms_thresh=0.3) over both.

--address: none = a private local Ray instance (dashboard on 127.0.0.1); auto / HOST:6379 / ray://HOST:10001
join a cluster from this machine, uploading xmodal's packages (every node needs the dependencies: torch,
...); http://HEAD:8265 submits this same command as a Ray Job (like `xmodal submit`), so give paths the
cluster can see.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from extraction.config import SELECTION_RULES
    from extraction.grid import FEATURE_KINDS
    from extraction.rcnn import FORWARD_MODES
    from pipelines.jobs.extract.config import SHARD_MODES, ExtractConfig
    from pipelines.jobs.image_inputs import ID_RULES

    def default(name: str) -> str:
        return f"(default: {config_default(ExtractConfig, name)})"

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "inputs", nargs="*", metavar="IMAGES_DIR_OR_LIST", help="image folders, list files or images"
    )
    parser.add_argument("--out", help="feature store to create or resume (e.g. feats.lmdb)")
    parser.add_argument(
        "--config", help="YAML with ExtractConfig keys (inputs, out, preset, batch_size, ...)"
    )
    parser.add_argument("--recursive", action="store_true", default=None, help="descend into sub-folders")
    parser.add_argument("--id-from", choices=ID_RULES, help=f"record id rule {default('id_from')}")
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="no progress bar (for logs and scripts)",
    )
    det = parser.add_argument_group("detector")
    det.add_argument(
        "--weights",
        help="detector checkpoint: faster_rcnn_from_caffe_attr.pkl, HuggingFace pytorch_model.bin, "
        ".safetensors, or a trained detector directory (RUN/best of `xmodal detector train`; its own "
        "architecture and class names) (default: random weights, for tests only)",
    )
    det.add_argument("--preset", help=f"detector preset {default('preset')}")
    det.add_argument(
        "--features",
        choices=FEATURE_KINDS,
        help=f"selected regions, or grid cells of the whole image {default('features')}",
    )
    det.add_argument(
        "--grid",
        metavar="ROWSxCOLS|native/K[@32]",
        help=f"cells of --features grid: e.g. 14x14, native/2, native/1@32 (res5 at stride 32) "
        f"{default('grid')}",
    )
    det.add_argument(
        "--selection", choices=SELECTION_RULES, help=f"region selection rule {default('selection')}"
    )
    det.add_argument("--min-boxes", type=int, help=f"fewest regions per image {default('min_boxes')}")
    det.add_argument("--max-boxes", type=int, help=f"most regions per image {default('max_boxes')}")
    det.add_argument("--min-size", type=int, help="input shortest side (default: the preset's, 600)")
    det.add_argument("--max-size", type=int, help="input longest side cap (default: the preset's, 1000)")
    det.add_argument(
        "--store-class-probs",
        action="store_true",
        default=None,
        help="also store each region's distribution over the detector's classes (1601 float16 values; "
        "ViLBERT's and VL-BERT's masked-region targets); same as --set class_probs=true",
    )
    det.add_argument(
        "--set",
        dest="detector_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other detector or selection setting, e.g. --set post_nms_topk=100 (repeatable)",
    )
    ray_group = parser.add_argument_group("Ray")
    ray_group.add_argument("--batch-size", type=int, help=f"images per detector call {default('batch_size')}")
    ray_group.add_argument(
        "--forward",
        choices=FORWARD_MODES,
        help="per-image: one image at a time through the network (the reference); batched: a call's "
        "images through the trunk together on padded canvases and all their RoIs through res5 at once "
        "(records bit for bit the same in any batch, equal to per-image up to rounding); auto: batched "
        f"on GPUs, per-image on CPU {default('forward')}",
    )
    ray_group.add_argument(
        "--shards",
        choices=SHARD_MODES,
        help="none: the driver writes one store; per-replica: each replica writes its own shard under "
        f"--out, read as one store (see below) {default('shards')}",
    )
    ray_group.add_argument(
        "--unit-batches",
        type=int,
        help=f"with --shards: detector batches per work unit handed to a replica {default('unit_batches')}",
    )
    ray_group.add_argument(
        "--workers",
        type=_workers,
        help="detector replicas, or auto: one per GPU of the cluster (every GPU; see --gpus-per-worker), "
        "else 1 on CPU (default: auto)",
    )
    ray_group.add_argument(
        "--gpus-per-worker", type=float, help=f"GPUs per replica {default('gpus_per_worker')}"
    )
    ray_group.add_argument(
        "--cpus-per-worker",
        type=float,
        help="CPUs reserved per replica, fractions allowed (default: 1 with GPUs; on CPU the "
        "cores left after decoding, shared)",
    )
    ray_group.add_argument(
        "--address", help="Ray cluster: auto, HOST:PORT, ray://HOST:10001 or http://HEAD:8265"
    )
    ray_group.add_argument(
        "--startup-timeout",
        type=float,
        metavar="SECONDS",
        help="give up (exit 1) when the replicas are not all started after this long "
        + default("startup_timeout"),
    )
    ray_group.add_argument(
        "--decode-timeout",
        type=float,
        metavar="SECONDS",
        help="skip (and log) an image not read and decoded within this long " + default("decode_timeout"),
    )
    ray_group.add_argument(
        "--max-failures",
        type=int,
        help=f"failed images tolerated before the exit status is 2 {default('max_failures')}",
    )
    add_overrides_argument(parser, "extract config overrides, e.g. batch_size=8 commit_seconds=5")


def _workers(text: str) -> int | None:
    """`--workers`: a count, or auto (None: one replica per GPU, else one)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of replicas or auto, got {text!r}") from None


def resolve_extract_config(args: argparse.Namespace):
    """ExtractConfig defaults < --config YAML < flags < KEY=VALUE overrides; `--set` detector settings and
    --min-size/--max-size merge into `overrides`."""
    from pipelines.engine import config_io
    from pipelines.jobs.extract.config import ExtractConfig

    inputs, overrides = split_overrides(args.inputs, args.overrides)
    cfg = config_io.load(ExtractConfig, args.config)
    flags = {
        "inputs": inputs or None,
        "out": args.out,
        "recursive": args.recursive,
        "id_from": args.id_from,
        "features": args.features,
        "grid": args.grid,
        "preset": args.preset,
        "weights": args.weights,
        "selection": args.selection,
        "min_boxes": args.min_boxes,
        "max_boxes": args.max_boxes,
        "batch_size": args.batch_size,
        "forward": args.forward,
        "shards": args.shards,
        "unit_batches": args.unit_batches,
        "workers": args.workers,
        "gpus_per_worker": args.gpus_per_worker,
        "cpus_per_worker": args.cpus_per_worker,
        "address": args.address,
        "startup_timeout": args.startup_timeout,
        "decode_timeout": args.decode_timeout,
        "max_failures": args.max_failures,
        "progress": args.progress,
    }
    cfg = config_io.merge(cfg, {k: v for k, v in flags.items() if v is not None}, where="command line")
    detector = _parse_overrides(args.detector_overrides)
    flagged = {"min_size": args.min_size, "max_size": args.max_size, "class_probs": args.store_class_probs}
    detector.update({k: v for k, v in flagged.items() if v is not None})
    if detector:
        cfg = config_io.merge(cfg, {"overrides": {**cfg.overrides, **detector}}, where="command line")
    return config_io.apply_overrides(cfg, overrides)


def run(args: argparse.Namespace) -> int:
    from pipelines.jobs.ray_runtime import is_job_api_address

    if is_job_api_address(args.address):
        return _submit_self(args)

    from extraction.config import resolve_config
    from pipelines.jobs.extract.config import SHARD_MODES, JobError, check_forward, grid_config
    from pipelines.jobs.extract.driver import run_extract
    from pipelines.jobs.image_inputs import InputError
    from storage import StoreError

    try:
        cfg = resolve_extract_config(args)
        if not cfg.inputs or not cfg.out:
            raise ValueError("give the image folders (or inputs: in --config) and --out (or out:)")
        if cfg.shards not in SHARD_MODES:
            raise ValueError(f"shards: {cfg.shards!r} is not one of {', '.join(SHARD_MODES)}")
        detector = {k: v for k, v in cfg.overrides.items() if k not in ("min_size", "max_size")}
        resolve_config(cfg.preset, cfg.selection, cfg.min_boxes, cfg.max_boxes, **detector)
        grid_config(cfg)
        check_forward(cfg)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    timeouts = min(cfg.startup_timeout, cfg.decode_timeout)
    if min(cfg.batch_size, cfg.unit_batches, cfg.workers or 1) < 1 or timeouts <= 0:
        log.error(
            "--batch-size, --unit-batches and --workers must be at least 1, --startup-timeout and "
            "--decode-timeout above 0"
        )
        return 1
    try:
        summary = run_extract(cfg)
    except (InputError, JobError, StoreError) as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        from pipelines.cli import EXIT_INTERRUPTED

        # run_extract's cleanup has closed the store: every record written so far is committed
        log.error(
            "stopped; the images extracted so far are kept in %s: rerun the same command to resume", cfg.out
        )
        return EXIT_INTERRUPTED
    print(json.dumps(summary.__dict__, indent=2))
    if summary.exit_code:
        log.error(
            "%d image(s) failed (more than --max-failures %d); see %s",
            summary.failed,
            cfg.max_failures,
            summary.errors,
        )
    return summary.exit_code


def cluster_argv(args: argparse.Namespace) -> list[str]:
    """This command's arguments for a run on the cluster itself (`--address` dropped)."""
    argv = ["extract", *args.inputs]
    flags = {
        "--out": args.out,
        "--config": args.config,
        "--id-from": args.id_from,
        "--features": args.features,
        "--grid": args.grid,
        "--weights": args.weights,
        "--preset": args.preset,
        "--selection": args.selection,
        "--min-boxes": args.min_boxes,
        "--max-boxes": args.max_boxes,
        "--min-size": args.min_size,
        "--max-size": args.max_size,
        "--batch-size": args.batch_size,
        "--forward": args.forward,
        "--shards": args.shards,
        "--unit-batches": args.unit_batches,
        "--workers": args.workers,
        "--gpus-per-worker": args.gpus_per_worker,
        "--cpus-per-worker": args.cpus_per_worker,
        "--startup-timeout": args.startup_timeout,
        "--decode-timeout": args.decode_timeout,
        "--max-failures": args.max_failures,
    }
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, str(value)]
    for item in args.detector_overrides:
        argv += ["--set", item]
    if args.recursive:
        argv.append("--recursive")
    if args.store_class_probs:
        argv.append("--store-class-probs")
    if args.progress is False:
        argv.append("--no-progress")
    return [*argv, *args.overrides]


def _parse_overrides(items: list[str]) -> dict:
    """`KEY=VALUE` strings to detector overrides, values read as YAML scalars (`0.3`, `[0.5, 1, 2]`)."""
    from pipelines.engine.config_io import parse_yaml

    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r} is not of the form KEY=VALUE (e.g. --set post_nms_topk=100)")
        overrides[key.strip()] = parse_yaml(text, f"--set {item!r}")
    return overrides


def _submit_self(args: argparse.Namespace) -> int:
    from pipelines.jobs.submission import submit_job

    argv = cluster_argv(args)
    log.info("submitting to %s: xmodal %s", args.address, shlex.join(argv))
    try:
        return submit_job(args.address, argv)
    except (ConnectionError, FileNotFoundError, ValueError) as exc:  # as `xmodal submit` reports them
        log.error("%s", exc)
        return 1
