"""`xmodal extract`: region features for image folders, on this machine or a Ray cluster, resumable."""

from __future__ import annotations

import argparse
import json
import logging
import shlex

log = logging.getLogger(__name__)

EPILOG = """\
inputs: image folders (files by suffix; --recursive descends), list files (.txt/.lst/.list: one path per
line, relative to the list's folder) or single images. Ids are file stems unless --id-from relpath;
duplicate ids stop the job before any work.

Resume is the default: ids already in --out are skipped, so rerun the same command after a crash.
Beside the store: NAME.errors.jsonl (this run's failed images: img_id, path, reason) and
NAME.summary.json (total, done, skipped, failed, images_per_s, elapsed_s, ...), also printed.
Exit status: 0; 2 when more than --max-failures images failed (after finishing all others); 1 for
unusable input (missing path, duplicate or too long ids, settings that differ from the existing store's),
replicas the cluster cannot start within --startup-timeout, or replicas that keep dying.

--address: none = a private local Ray instance (dashboard on 127.0.0.1); auto / HOST:6379 / ray://HOST:10001
join a cluster from this machine, uploading xmodal's packages (every node needs the dependencies: torch,
...); http://HEAD:8265 submits this same command as a Ray Job (like `xmodal submit`), so give paths the
cluster can see.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "inputs", nargs="+", metavar="IMAGES_DIR_OR_LIST", help="image folders, list files or images"
    )
    parser.add_argument("--out", required=True, help="feature store to create or resume (e.g. feats.lmdb)")
    parser.add_argument("--recursive", action="store_true", help="descend into sub-folders")
    parser.add_argument(
        "--id-from", choices=("stem", "relpath"), default="stem", help="record id rule (default: stem)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and scripts)")
    det = parser.add_argument_group("detector")
    det.add_argument(
        "--weights",
        help="detector checkpoint: faster_rcnn_from_caffe_attr.pkl, HuggingFace pytorch_model.bin or "
        ".safetensors (default: random weights, for tests only)",
    )
    det.add_argument("--preset", default="vg-r101-c4", help="detector preset (default: vg-r101-c4, LXMERT's)")
    det.add_argument(
        "--selection",
        default="caffe",
        choices=("caffe", "maxnms", "threshold"),
        help="region selection rule (default: caffe)",
    )
    det.add_argument("--min-boxes", type=int, default=36, help="fewest regions per image (default: 36)")
    det.add_argument("--max-boxes", type=int, default=36, help="most regions per image (default: 36)")
    det.add_argument("--min-size", type=int, help="input shortest side (default: the preset's, 600)")
    det.add_argument("--max-size", type=int, help="input longest side cap (default: the preset's, 1000)")
    det.add_argument(
        "--set",
        dest="detector_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other detector or selection setting, e.g. --set post_nms_topk=100 (repeatable)",
    )
    ray_group = parser.add_argument_group("Ray")
    ray_group.add_argument("--batch-size", type=int, default=4, help="images per detector call (default: 4)")
    ray_group.add_argument(
        "--workers", type=int, help="detector replicas (default: one per GPU, else 1 on CPU)"
    )
    ray_group.add_argument("--gpus-per-worker", type=float, default=1.0, help="GPUs per replica (default: 1)")
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
        help="give up (exit 1) when the replicas are not all started after this long (default: 600)",
    )
    ray_group.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="failed images tolerated before the exit status is 2 (default: 0)",
    )


def run(args: argparse.Namespace) -> int:
    from pipelines.ray_runtime import is_job_api_address

    if is_job_api_address(args.address):
        return _submit_self(args)

    from extraction.config import resolve_config
    from pipelines.extract import ExtractConfig, JobError, run_extract
    from pipelines.image_inputs import InputError
    from storage import StoreError

    try:
        overrides = _parse_overrides(args.detector_overrides)
        resolve_config(args.preset, args.selection, args.min_boxes, args.max_boxes, **overrides)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    overrides.update(
        {k: v for k, v in (("min_size", args.min_size), ("max_size", args.max_size)) if v is not None}
    )
    cfg = ExtractConfig(
        inputs=list(args.inputs),
        out=args.out,
        recursive=args.recursive,
        id_from=args.id_from,
        preset=args.preset,
        weights=args.weights,
        selection=args.selection,
        min_boxes=args.min_boxes,
        max_boxes=args.max_boxes,
        overrides=overrides,
        batch_size=args.batch_size,
        workers=args.workers,
        gpus_per_worker=args.gpus_per_worker,
        cpus_per_worker=args.cpus_per_worker,
        address=args.address,
        max_failures=args.max_failures,
        progress=not args.no_progress,
        **({"startup_timeout": args.startup_timeout} if args.startup_timeout is not None else {}),
    )
    if cfg.batch_size < 1 or (cfg.workers is not None and cfg.workers < 1) or cfg.startup_timeout <= 0:
        log.error("--batch-size and --workers must be at least 1, --startup-timeout above 0")
        return 1
    try:
        summary = run_extract(cfg)
    except (InputError, JobError, StoreError) as exc:
        log.error("%s", exc)
        return 1
    print(json.dumps(summary.__dict__, indent=2))
    if summary.exit_code:
        log.error(
            "%d image(s) failed (more than --max-failures %d); see %s",
            summary.failed,
            args.max_failures,
            summary.errors,
        )
    return summary.exit_code


def cluster_argv(args: argparse.Namespace) -> list[str]:
    """This command's arguments for a run on the cluster itself (`--address` dropped)."""
    argv = ["extract", *args.inputs, "--out", args.out, "--id-from", args.id_from]
    flags = {
        "--weights": args.weights,
        "--preset": args.preset,
        "--selection": args.selection,
        "--min-boxes": args.min_boxes,
        "--max-boxes": args.max_boxes,
        "--min-size": args.min_size,
        "--max-size": args.max_size,
        "--batch-size": args.batch_size,
        "--workers": args.workers,
        "--gpus-per-worker": args.gpus_per_worker,
        "--cpus-per-worker": args.cpus_per_worker,
        "--startup-timeout": args.startup_timeout,
        "--max-failures": args.max_failures,
    }
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, str(value)]
    for item in args.detector_overrides:
        argv += ["--set", item]
    if args.recursive:
        argv.append("--recursive")
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def _parse_overrides(items: list[str]) -> dict:
    """`KEY=VALUE` strings to detector overrides, values read as YAML scalars (`0.3`, `[0.5, 1, 2]`)."""
    import yaml

    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r} is not of the form KEY=VALUE (e.g. --set post_nms_topk=100)")
        overrides[key.strip()] = yaml.safe_load(text)
    return overrides


def _submit_self(args: argparse.Namespace) -> int:
    from pipelines.job_submission import submit_job

    argv = cluster_argv(args)
    log.info("submitting to %s: xmodal %s", args.address, shlex.join(argv))
    return submit_job(args.address, argv)
