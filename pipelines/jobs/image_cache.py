"""A feature store for the images a fine-tuning or evaluation run names, extracted from a folder into a
cache: only the images the rows need, resumable, and reused by the next run over the same folder."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from pipelines.data.image_refs import IMAGE_SUFFIXES, AmbiguousImage, ImageIds
from pipelines.jobs.extract.config import ExtractConfig, grid_config
from pipelines.jobs.image_inputs import InputError, iter_images
from storage.checks import cache_root

log = logging.getLogger(__name__)

MAX_NAMED = 5


def cache_store_path(images: str | Path, cfg: ExtractConfig, cache: str | Path | None = None) -> Path:
    """The store for `images` under `cfg`'s detector settings: one per folder and the features they make,
    so a second run (or another task, or `evaluate --images` after `finetune --images`) over the same
    folder reuses what the first extracted. The key is what decides the features, as the store's
    provenance records them (the detector's resolved configs, its weights by their sha256, the grid, the
    dtype), not how the settings were spelled: a detector directory's own sizes given again as overrides,
    or the same weights under another path, name the same store."""
    from extraction.provenance import deciding_entries, expected_provenance

    folder = Path(images).resolve()
    cells = grid_config(cfg)
    record = expected_provenance(
        cfg.preset,
        cfg.weights,
        cfg.selection,
        cfg.min_boxes,
        cfg.max_boxes,
        cells.spec if cells is not None else None,
        **cfg.overrides,
    )
    settings = {"folder": str(folder), **deciding_entries(record), "dtype": cfg.dtype}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^\w.-]+", "_", folder.name) or "images"
    return Path(cache or cache_root()) / "stores" / f"{name}-{digest}.lmdb"


def config_for_run(recorded: dict, cfg: ExtractConfig, given: set[str], run: str) -> ExtractConfig:
    """`cfg` set to extract as the store `run` was trained on was extracted (`recorded`, that store's
    provenance): the settings that decide the features (detector weights, preset, boxes or grid, selection,
    input size...) come from the record unless `given` (the fields the user set: theirs are checked, not
    replaced). InputError naming each difference when the features would differ, or when the recorded
    weights are gone and none are given."""
    from extraction.provenance import detector_settings, differences

    if "config" not in recorded:
        log.warning(
            "%s records no extraction settings (an imported store, or one merged from stores made "
            "differently): --images extracts with the settings given, which may not be how its features "
            "were made",
            run,
        )
        return cfg
    settings = detector_settings(recorded)
    path = recorded.get("weights")
    if settings["weights"] is None and path not in (None, "random") and "weights" not in given:
        raise InputError(
            f"{run} was trained on features from the detector weights {path}, which are gone; give the "
            "same weights with --detector-weights"
        )
    grid = settings.pop("grid", None)
    fields = {
        k: settings.pop(k)
        for k in ("preset", "weights", "selection", "min_boxes", "max_boxes")
        if k in settings
    }
    fields.update(features="grid" if grid else "regions", grid=grid or cfg.grid)
    fields = {k: v for k, v in fields.items() if k not in given}
    fields["overrides"] = {**settings, **(cfg.overrides if "overrides" in given else {})}
    fitted = replace(cfg, **fields)
    cells = grid_config(fitted)
    found = differences(
        recorded,
        fitted.preset,
        fitted.weights,
        fitted.selection,
        fitted.min_boxes,
        fitted.max_boxes,
        cells.spec if cells is not None else None,
        **fitted.overrides,
    )
    if found:
        raise InputError(
            f"{run} was trained on features extracted otherwise than these settings would: "
            f"{'; '.join(found)}; drop them from --detector-weights/--extract-config (the run's own are "
            "used) or give the run's"
        )
    return fitted


def needed_ids(images: str | Path, refs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """{reference: folder id (its path in the folder)} for each (reference, where it is used); InputError
    naming every reference the folder lacks or holds twice."""
    listing = {item.img_id: item.path for item in iter_images([images], recursive=True, id_from="relpath")}
    ids = ImageIds.of(listing)
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    ambiguous: list[str] = []
    for ref, where in refs:
        if ref in found or ref in missing:
            continue
        try:
            img_id = ids.resolve(ref)
        except AmbiguousImage as exc:
            ambiguous.append(str(exc))
            continue
        if img_id is None:
            missing[ref] = where
        else:
            found[ref] = img_id
    problems = [f"{images}: {'; '.join(ambiguous[:MAX_NAMED])}"] if ambiguous else []
    # a picture that is there under a suffix the folder listing skips: say so, not "missing"
    unread = {r: _unread_suffix(images, r) for r in missing if _unread_suffix(images, r)}
    if unread:
        problems.append(
            f"{images}: the rows name pictures with suffixes xmodal does not read "
            f"({', '.join(sorted(set(unread.values())))}), e.g. {next(iter(unread))!r}; convert them to .jpg "
            f"or .png (readable: {', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    missing = {r: w for r, w in missing.items() if r not in unread}
    if missing:
        named = ", ".join(f"{r!r} ({w})" for r, w in list(missing.items())[:MAX_NAMED])
        more = f" and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else ""
        problems.append(
            f"{len(missing)} images named by the rows are not in {images}: {named}{more}; "
            "fix the rows' image names or add the pictures"
        )
    if problems:  # every problem of the rows at once, so one fix-and-rerun settles them
        raise InputError("; and ".join(problems))
    return found


def _unread_suffix(images: str | Path, ref: str) -> str | None:
    """The suffix of `ref` when the folder holds that file but not as a picture xmodal reads (.heic)."""
    suffix = Path(ref).suffix.lower()
    if not suffix or suffix in IMAGE_SUFFIXES or not (Path(images) / ref).is_file():
        return None
    return suffix


def images_store(
    images: str | Path,
    refs: Iterable[tuple[str, str]],
    settings: ExtractConfig | None = None,
    cache: str | Path | None = None,
) -> Path:
    """The cached store holding every image `refs` names in the folder `images`, extracting those it
    lacks first (the extract job's own resume: an interrupted run continues where it stopped)."""
    from pipelines.jobs.extract.driver import run_extract, summary_path
    from storage import FeatureReader

    if not Path(images).is_dir():
        raise InputError(f"--images {images}: not a folder; give the folder holding the pictures")
    from extraction.weights import effective_overrides
    from pipelines.jobs.extract.config import check_weights

    cfg = settings or ExtractConfig()
    if cfg.weights:
        check_weights(cfg.weights)  # before its sha256 names the store
    # spelled alike on every path, so that a resumed store's recorded settings match
    overrides = effective_overrides(
        cfg.preset, cfg.weights, cfg.selection, cfg.min_boxes, cfg.max_boxes, **cfg.overrides
    )
    cfg = replace(cfg, overrides=overrides)
    wanted = sorted(set(needed_ids(images, refs).values()))
    out = cache_store_path(images, cfg, cache)
    if (out / "data.mdb").is_file():
        reader = FeatureReader(out)
        todo = sum(1 for i in wanted if i not in reader)
        reader.close()
    else:
        todo = len(wanted)
    if todo == 0:
        log.info("all %d images are in the cache store %s", len(wanted), out)
        return out
    log.info("extracting %d of %d images into the cache store %s", todo, len(wanted), out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # absolute: the job's workers may run elsewhere (a Ray cluster started in another folder)
    folder = str(Path(images).resolve())
    job = replace(cfg, inputs=[folder], out=str(out), recursive=True, id_from="relpath", only_ids=wanted)
    summary = run_extract(job)
    if summary.failed:
        raise InputError(
            f"{summary.failed} of the images could not be read (see {summary.errors}); fix or remove "
            f"them and rerun (the {summary.done} extracted are kept in {out}; summary {summary_path(out)})"
        )
    return out
