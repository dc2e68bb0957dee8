"""Evaluate a fine-tuned directory on a split: official-format predictions, metrics when labelled."""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from torch.utils.data import DataLoader

from extraction.provenance import provenance_differences
from pipelines.data.examples import check_images
from pipelines.data.image_refs import StoreImages
from pipelines.engine.devices import DEFAULT_DEVICE, pick_device
from pipelines.engine.trainer import to_device
from pipelines.engine.worker_errors import Carrying, carrying_collate, raising
from pipelines.tasks.finetuned import finetuned_run_file, load_finetuned
from storage import FeatureReader

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 64


def metrics_path(predictions_path: str | Path) -> Path:
    """Where the metrics JSON goes: beside the predictions, `<stem>.metrics.json`."""
    path = Path(predictions_path)
    return path.with_name(f"{path.stem}.metrics.json")


def joined_path(predictions_path: str | Path) -> Path:
    """Where the predictions joined to their examples go: beside them, `<stem>.joined.jsonl`."""
    path = Path(predictions_path)
    return path.with_name(f"{path.stem}.joined.jsonl")


def recorded_extraction(checkpoint: str | Path) -> dict:
    """The provenance of the features `checkpoint` was fine-tuned on ({} when the store recorded none)."""
    return json.loads(finetuned_run_file(checkpoint).read_text()).get("detector") or {}


def check_extraction(recorded: dict, store: FeatureReader, checkpoint: str | Path) -> None:
    """ValueError naming every setting in which a store's extraction differs from the one the run was
    fine-tuned on (detector weights, boxes, grid, sizes, thresholds); stores or runs that recorded none
    (imported features) are not compared."""
    if not recorded:
        return
    for shard in store.shards:
        here = shard.read_meta().get("provenance")
        found = provenance_differences(recorded, here) if here else []
        if found:
            raise ValueError(
                f"{shard.path} was extracted unlike the features {checkpoint} was fine-tuned on: "
                f"{'; '.join(found)}; evaluate on a store made with the run's settings (or --images DIR, "
                "which extracts with them)"
            )


def write_joined(path: str | Path, kind, examples: Sequence, predictions: dict) -> Path:
    """One JSON line per example: what it asks (image, question, references) and the prediction."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            row = {**kind.describe(ex), "prediction": predictions.get(ex.key)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def evaluate(
    checkpoint: str | Path,
    features: Sequence[str | Path],
    split: Sequence[str | Path],
    out: str | Path,
    task: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = DEFAULT_DEVICE,
    loader_workers: int = 0,
    beam_size: int | None = None,
) -> dict[str, float] | None:
    """Predict every example of `split`, write `out` in the task's official format, and return the metrics
    (also written to `metrics_path(out)`) when every example is labelled; None otherwise. Captions are
    decoded with `beam_size` beams, by default the run's test decoding (`test_beam_size`, e.g. the
    self-critical recipes' 5), else what its validation used; likewise its `<unk>` penalty and length."""
    dev = pick_device(device)
    tuned = load_finetuned(checkpoint, dev)
    if task is not None and task != tuned.task:
        raise ValueError(f"{checkpoint} was fine-tuned for {tuned.task}, not {task}")
    kind = tuned.kind
    options = {}
    settings = tuned.settings
    if beam_size is None:
        beam_size = settings.get("test_beam_size") or settings.get("beam_size")
    if beam_size is not None:
        if "beam_size" not in inspect.signature(kind.predict).parameters:
            raise ValueError(f"--beam-size applies to captioners; {tuned.task} predictions are not decoded")
        if beam_size < 1:
            raise ValueError(f"--beam-size must be at least 1, got {beam_size}")
        options["beam_size"] = beam_size
        # the decoding the run's recipe tests with, else the one it validated with
        unk_penalty = settings.get("test_unk_penalty")
        if unk_penalty is None:
            unk_penalty = settings.get("unk_penalty")
        if unk_penalty is not None:
            options["unk_penalty"] = unk_penalty
        if settings.get("decode_max_length") is not None:
            options["max_length"] = settings["decode_max_length"]
    examples = kind.load_examples(split)
    if not examples:
        raise ValueError(f"{', '.join(map(str, split))} holds no example")
    store = FeatureReader(features)
    reader = StoreImages(store)
    if reader.feature_dim != tuned.model.config.visual_feat_dim:
        raise ValueError(
            f"the store holds {reader.feature_dim}-d features, the model expects "
            f"{tuned.model.config.visual_feat_dim}-d; evaluate on features from the same detector"
        )
    check_extraction(recorded_extraction(checkpoint), store, checkpoint)
    check_images(examples, reader, f"split {', '.join(map(str, split))}")
    dataset = kind.dataset(examples, reader, tuned.tokenizer, tuned.answers, tuned.max_length)
    loader = DataLoader(
        Carrying(dataset),
        batch_size=batch_size,
        shuffle=False,
        num_workers=loader_workers,
        collate_fn=carrying_collate(
            functools.partial(kind.collate_items, pad_id=tuned.tokenizer.pad_token_id)
        ),
    )
    batches = (to_device(b, dev) for b in raising(loader))
    predictions, loss = kind.predict(tuned.model, batches, tuned.answers, **options)
    path = kind.write_predictions(out, predictions)
    joined = write_joined(joined_path(path), kind, examples, predictions)
    log.info("wrote %d predictions to %s (with their examples: %s)", len(predictions), path, joined)
    if any(e.label is None for e in examples):
        log.info("the split is (partly) unlabelled: no metrics, submit %s to the evaluation server", path)
        return None
    metrics = kind.score(predictions, examples)
    if loss is not None:
        metrics["loss"] = loss
    metrics_path(path).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
