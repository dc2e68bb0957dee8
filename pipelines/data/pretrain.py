"""Pre-training data: the community JSON files (`img_id`, `sentf`, `labelf`) and a dataset over the store."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset

from pipelines.data.json_rows import read_json
from pipelines.data.regions import region_arrays
from storage import FeatureReader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PretrainExample:
    """One (image, sentence) pair; `label` is the sentence's {answer: score} when it is a question."""

    img_id: str
    sentence: str
    source: str
    label: dict[str, float] | None = None


def read_pretrain_json(paths: Sequence[str | Path]) -> list[PretrainExample]:
    """One example per (image, sentence); a malformed row raises ValueError naming the file and the row."""
    examples: list[PretrainExample] = []
    for path in paths:
        path = Path(path)
        rows = read_json(path)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of {{img_id, sentf, labelf}} rows")
        for i, row in enumerate(rows):
            examples.extend(_parse_row(row, f"{path}: row {i}"))
    return examples


def _parse_row(row: object, where: str) -> list[PretrainExample]:
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: expected an object with img_id, sentf and labelf, got {type(row).__name__}"
        )
    img_id = row.get("img_id")
    if not isinstance(img_id, str) or not img_id:
        raise ValueError(f"{where}: 'img_id' must be a non-empty string, got {img_id!r}")
    where = f"{where} (img_id {img_id!r})"
    sentf = row.get("sentf")
    if not isinstance(sentf, dict):
        raise ValueError(f"{where}: 'sentf' must map a source to a list of sentences")
    labelf = row.get("labelf") or {}
    if not isinstance(labelf, dict):
        raise ValueError(f"{where}: 'labelf' must map a source to a list of {{answer: score}}")
    out = []
    for source, sents in sentf.items():
        if not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
            raise ValueError(f"{where}: sentf[{source!r}] must be a list of strings")
        labels = labelf.get(source)
        if labels is not None and (not isinstance(labels, list) or len(labels) != len(sents)):
            raise ValueError(
                f"{where}: labelf[{source!r}] must be a list aligned with sentf[{source!r}] "
                f"({len(sents)} sentences)"
            )
        for k, sent in enumerate(sents):
            label = None
            if labels is not None:
                label = labels[k]
                if not isinstance(label, dict) or not all(
                    isinstance(a, str) and isinstance(s, (int, float)) for a, s in label.items()
                ):
                    raise ValueError(f"{where}: labelf[{source!r}][{k}] must be an {{answer: score}} object")
            out.append(PretrainExample(img_id, sent, source, label))
    return out


def check_image_ids(
    examples: list[PretrainExample], features: FeatureReader, files: Iterable[str | Path], skip_missing: bool
) -> list[PretrainExample]:
    """Every image must be in the feature sets: raise with a count and examples, or drop them."""
    ids = {e.img_id for e in examples}
    missing = sorted(i for i in ids if i not in features)
    if not missing:
        return examples
    stores = ", ".join(str(p) for p in features.paths)
    names = ", ".join(str(f) for f in files)
    if not skip_missing:
        raise ValueError(
            f"{len(missing)} of {len(ids)} image ids in {names} are not in the feature sets ({stores}), "
            f"e.g. {missing[:5]}; extract them, or pass --skip-missing to drop their sentences"
        )
    gone = set(missing)
    kept = [e for e in examples if e.img_id not in gone]
    log.warning(
        "skipping %d sentences of %d images missing from %s, e.g. %s",
        len(examples) - len(kept),
        len(missing),
        stores,
        missing[:5],
    )
    return kept


class PretrainDataset(Dataset):
    """Example i: its sentence and its image's regions (boxes normalised to [0, 1], features float32).

    `evaluation` marks the items of a validation set, for which the collator adds the QA accuracy inputs.
    The feature reader opens its LMDB lazily in whichever process reads first (each DataLoader worker)."""

    def __init__(
        self,
        examples: list[PretrainExample],
        features: FeatureReader,
        answers: list[tuple[tuple[int, float], ...]] | None = None,
        evaluation: bool = False,
    ):
        if answers is not None and len(answers) != len(examples):
            raise ValueError(f"{len(answers)} answer lists for {len(examples)} examples")
        self.examples = examples
        self.features = features
        self.answers = answers  # per example: ((label, score), ...) of its answers in the table
        self.evaluation = evaluation

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        rec = self.features[ex.img_id]
        features, boxes = region_arrays(rec)
        return {
            "img_id": ex.img_id,
            "answers": self.answers[i] if self.answers is not None else (),
            "question": ex.label is not None,  # labelled (even with no answer in the table): a question
            "source": ex.source,
            "evaluation": self.evaluation,
            "sentence": ex.sentence,
            "features": features,
            "boxes": boxes,
            "objects_id": rec.objects_id,
            "objects_conf": rec.objects_conf,
            "attrs_id": rec.attrs_id,
            "attrs_conf": rec.attrs_conf,
        }
