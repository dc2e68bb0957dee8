"""`--images DIR` for the commands that read rows (finetune, evaluate): the images the rows name are
extracted into a cache store first (pipelines.jobs.image_cache), so a folder and a file make a model."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def add_images_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("features from an image folder")
    group.add_argument(
        "--images",
        metavar="DIR",
        help="folder of the pictures the rows name (sub-folders too): extract those not yet cached, then "
        "use the cache store instead of --features",
    )
    group.add_argument(
        "--detector-weights",
        metavar="PATH",
        help="detector checkpoint for --images (as `extract --weights`; default: evaluate: the run's, "
        "finetune: random weights, tests only)",
    )
    group.add_argument(
        "--extract-config",
        metavar="YAML",
        help="ExtractConfig keys for --images (preset, max_boxes, batch_size, overrides, ...; evaluate "
        "checks them against the run's)",
    )
    group.add_argument(
        "--cache", metavar="DIR", help="where cache stores go (default: $XMODAL_CACHE, else ~/.cache/xmodal)"
    )


def store_for_rows(
    args: argparse.Namespace,
    load_examples: Callable,
    files: Sequence[str],
    run: str | None = None,
    recorded: dict | None = None,
):
    """The cache store holding every image the rows of `files` name, extracted from `args.images`; for a
    trained `run`, extracted as the features it was trained on were (`recorded`, their provenance), the
    settings given checked against those (pipelines.jobs.image_cache.config_for_run)."""
    from pipelines.engine import config_io
    from pipelines.jobs.extract.config import ExtractConfig, JobError
    from pipelines.jobs.image_cache import config_for_run, images_store
    from storage import StoreError

    if args.features:
        raise ValueError("give --features or --images, not both")
    cfg = config_io.load(ExtractConfig, args.extract_config)
    if args.detector_weights:
        cfg = config_io.merge(cfg, {"weights": args.detector_weights}, where="command line")
    if run is not None:
        given = set(config_io.load_yaml(args.extract_config)) if args.extract_config else set()
        if args.detector_weights:
            given.add("weights")
        cfg = config_for_run(recorded or {}, cfg, given, run)
    refs = []
    for path in files:
        refs += [(img, str(path)) for ex in load_examples([path]) for img in ex.images]
    try:
        return images_store(args.images, refs, cfg, args.cache)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"stopped while extracting {args.images}; the images extracted so far are kept in the cache: "
            "rerun the same command to resume"
        ) from None
    except (
        JobError,
        StoreError,
    ) as exc:  # the extraction job's replicas could not run: one line, as `extract` says it
        raise ValueError(f"extracting {args.images}: {exc}") from exc
