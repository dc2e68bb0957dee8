"""VQA/GQA data: question rows (LXMERT's, or image/question/answer as JSON, CSV or Parquet), a dataset
read by micro-batch, collation with soft targets."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.answers import AnswerTable, PairAnswers, answer_counts, answer_labels, flat_entries
from pipelines.data.column_tokens import row_tokens
from pipelines.data.columns import TABLE, TEXT, RowColumns, cached_arrays
from pipelines.data.image_refs import image_ref
from pipelines.data.regions import PaddedRegions, read_regions
from pipelines.data.row_files import RowProblems, json_cell, kind_of, rows_and_problems
from pipelines.data.vqa_official import OfficialVQA, annotations_beside


@dataclass(frozen=True)
class QAExample:
    """One VQA or GQA question; `label` maps answers to soft scores and is None in unlabelled splits."""

    question_id: int | str
    img_id: str
    sent: str
    label: dict[str, float] | None = None
    answer_type: str | None = None
    question_type: str | None = None

    @property
    def key(self) -> int | str:
        return self.question_id

    @property
    def images(self) -> tuple[str, ...]:
        return (self.img_id,)


QA_EXPECTED = (
    '{"image": "sub/a.jpg", "question": "what colour is the car?", "answer": "red"} '
    "(or answers: a list or {answer: count}, or LXMERT's question_id/img_id/sent/label)"
)
IMAGE_FIELDS = ("img_id", "image", "image_id", "imageId", "image_path", "file_name", "filename")
QUESTION_FIELDS = ("sent", "question")
ID_FIELDS = ("question_id", "questionId", "id")


def answer_score(count: int) -> float:
    """The release's soft score for an answer given by `count` annotators (of VQA's ten): 0.3 each, 1 from
    four on (LXMERT's preprocessing `get_score`)."""
    return min(1.0, 0.3 * count) if count < 4 else 1.0


def _first(row: dict, names: tuple[str, ...]) -> tuple[str | None, object]:
    for name in names:
        if name in row and row[name] is not None and row[name] != "":
            return name, row[name]
    return None, None


def _answer_text(value: object) -> str | None:
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _qa_label(row: dict, problems: list[str]) -> dict[str, float] | None:
    """The soft label of a row's `label`, `answers` or `answer`; None when it has none."""
    if row.get("label") not in (None, ""):
        label = json_cell(row["label"], strict=True)
        numeric = (int, float)
        if not isinstance(label, dict) or not all(
            isinstance(k, str) and isinstance(v, numeric) and not isinstance(v, bool)
            for k, v in label.items()
        ):
            problems.append(f"'label' must map answers to scores, not {str(row['label'])[:40]!r}")
            return None
        return {k: float(v) for k, v in label.items()}
    if row.get("answers") not in (None, ""):
        answers = json_cell(row["answers"], strict=True)
        if isinstance(answers, str):  # a CSV cell: `red|red|dark red`
            answers = answers.split("|")
        if isinstance(answers, dict):
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in answers.values()):
                problems.append("'answers' as an object must map answers to counts (whole numbers)")
                return None
            counts = {str(k).strip(): v for k, v in answers.items() if str(k).strip()}
        elif isinstance(answers, list):
            texts = [_answer_text(a.get("answer") if isinstance(a, dict) else a) for a in answers]
            if not texts or any(t is None for t in texts):
                problems.append("'answers' must list answer strings (or VQA's {\"answer\": ...} objects)")
                return None
            counts = dict(Counter(texts))
        else:
            problems.append(f"'answers' is {kind_of(answers)} (give a list or {{answer: count}})")
            return None
        return {a: answer_score(n) for a, n in counts.items() if n > 0}
    if row.get("answer") not in (None, ""):
        text = _answer_text(row["answer"])
        if text is None:
            problems.append(f"'answer' is {kind_of(row['answer'])} (give the answer as text)")
            return None
        return {text: 1.0}
    return None


def _made_up_id(image: str, question: str, taken: dict) -> str:
    """A question id from the image and the question, so that it survives reordering the file."""
    digest = hashlib.sha1(f"{image}\0{question}".encode()).hexdigest()[:12]
    qid, n = digest, 1
    while qid in taken:
        n += 1
        qid = f"{digest}-{n}"
    return qid


def load_qa_examples(paths: str | Path | Iterable[str | Path]) -> list[QAExample]:
    """Questions of row files (JSON list, JSON lines, CSV, Parquet): LXMERT's `{question_id, img_id, sent,
    label}` rows, `{image, question, answer | answers}` rows whose question id, when absent, is made up
    from the image and the question, or the official VQA questions file with its annotations (given too,
    or beside it under the release's name). A file with malformed rows is refused listing every problem."""
    return [QAExample(**r) for r in _qa_records(paths)]


def load_qa_rows(paths: str | Path | Iterable[str | Path], cache_dir: str | Path | None = None) -> QARows:
    """The questions `load_qa_examples` reads, as columns: converted once into `cache_dir` (keyed by the
    files, and the official annotations beside a questions file) and mapped from there; in memory without
    one."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not all(p.is_file() for p in paths):  # a folder, or a missing file refused while reading
        cache_dir = None
    beside = [a for a in map(annotations_beside, paths) if a is not None and a.is_file() and a not in paths]
    return QARows.load(lambda: map(_qa_columns, _qa_records(paths)), [*paths, *beside], cache_dir)


def _qa_records(paths: str | Path | Iterable[str | Path]) -> Iterator[dict]:
    """The `QAExample` fields of each question of `paths`, file by file; a file's problems are raised
    after its last row."""
    seen: dict[int | str, Path] = {}
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    official = OfficialVQA.among(paths)
    for path in paths:
        if path in official.annotations:
            continue  # joined to their questions
        if path in official.questions:
            rows, problems = official.rows(path), RowProblems(path)
        else:  # a CSV's malformed lines are named with the other rows' problems
            rows, problems = rows_and_problems(path)
        empty_answers, answered = [], False  # an empty cell among answered rows is a mistake, not a test row
        for row in rows:
            fields = row.fields
            issues: list[str] = []
            img_name, img_value = _first(fields, IMAGE_FIELDS)
            image = image_ref(img_value)
            if img_name is None:
                issues.append("no 'image'")
            elif image is None:
                issues.append(f"{img_name!r} is {kind_of(img_value)} (give the image's file name)")
            q_name, question = _first(fields, QUESTION_FIELDS)
            if q_name is None:
                issues.append("no 'question'")
            elif not isinstance(question, str) or not question.strip():
                issues.append(f"{q_name!r} is {kind_of(question)} (give the question as text)")
                question = None
            label = _qa_label(fields, issues)
            answered = answered or label is not None
            if label is None and any(fields.get(k) == "" for k in ("answer", "answers", "label")):
                empty_answers.append(row)
            _, qid = _first(fields, ID_FIELDS)
            if qid is not None and (not isinstance(qid, (int, str)) or isinstance(qid, bool)):
                issues.append(f"'question_id' is {kind_of(qid)} (give a number or text)")
            if qid is not None and qid in seen:
                issues.append(f"question_id {qid!r} repeats (first in {seen[qid]})")
            if issues:
                for issue in issues:
                    problems.add(row, issue)
                continue
            if qid is None:
                qid = _made_up_id(image, question, seen)
            seen[qid] = path
            yield {
                "question_id": qid,
                "img_id": image,
                "sent": question.strip(),
                "label": label,
                "answer_type": fields.get("answer_type"),
                "question_type": fields.get("question_type"),
            }
        for row in empty_answers if answered else ():
            problems.add(row, "the answer is empty")
        problems.raise_if_any(QA_EXPECTED)


def _qa_columns(record: dict) -> dict:
    """A `_qa_records` record as a row of `QARows.SCHEMA`."""
    qid, label = record["question_id"], record["label"]
    return {
        "qid": str(qid),
        "qid_int": isinstance(qid, int),
        "image": record["img_id"],
        "sent": record["sent"],
        "labelled": label is not None,
        "answer": list((label or {}).items()),
        "answer_type": _hashable(record["answer_type"]),
        "question_type": _hashable(record["question_type"]),
    }


def _hashable(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return json.dumps(value, default=str)
    return value


class QARows(RowColumns):
    """Questions as columns (see `RowColumns`); item i is question i's `QAExample`, built on demand."""

    SCHEMA: ClassVar[dict] = {
        "qid": TEXT,  # the question id as text; `qid_int`: it was a number
        "qid_int": np.bool_,
        "image": TABLE,
        "sent": TEXT,
        "labelled": np.bool_,  # the question has a label (maybe empty)
        "answer": {"ids": TABLE, "scores": np.float64},  # the label's (answer, score) entries in order
        "answer_type": TABLE,
        "question_type": TABLE,
    }
    KIND = "qa-rows"
    VERSION = 1
    IMAGES = ("image",)

    @classmethod
    def from_examples(cls, examples: Sequence[QAExample]) -> QARows:
        """Examples already in memory as in-memory columns."""
        fields = ("question_id", "img_id", "sent", "label", "answer_type", "question_type")
        return cls.build(_qa_columns({f: getattr(e, f) for f in fields}) for e in examples)

    def keys(self, indices) -> list[int | str]:
        """The question ids of rows `indices` (numbers stay numbers, text stays text)."""
        flags = self.columns["qid_int"][self.base(indices)].tolist()
        return [int(q) if n else q for q, n in zip(self.texts("qid", indices), flags, strict=True)]

    def example(self, i: int) -> QAExample:
        at = int(self.base(i))
        label = dict(self.items("answer", i)) if self.columns["labelled"][at] else None
        return QAExample(
            question_id=self.keys([i])[0],
            img_id=self.values("image", [i])[0],
            sent=self.texts("sent", [i])[0],
            label=label,
            answer_type=self.values("answer_type", [i])[0],
            question_type=self.values("question_type", [i])[0],
        )

    def unlabelled_keys(self) -> list[int | str]:
        return self.keys(np.nonzero(~np.asarray(self.column("labelled")))[0])

    def _entries(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.columns
        return flat_entries(c["answer_offsets"], c["answer_ids"], c["answer_scores"], self.rows, lo, hi)

    def answer_counts(self, normalize) -> Counter[str]:
        """For each answer as `normalize` gives it, the number of selected questions listing it."""
        return answer_counts(self.tables["answer_ids"], self._entries, len(self), normalize)

    def answer_labels(self, table: AnswerTable) -> PairAnswers:
        """Each selected question's answers as labels of `table` (as `AnswerTable.labels`), flat."""
        return answer_labels(self.tables["answer_ids"], self._entries, len(self), table)

    def targets(self, table: AnswerTable, cache_dir: str | Path | None) -> PairAnswers:
        """Every question's answers (all rows of the columns, not just the selected: index them with
        `base`) as labels of `table`; kept beside the columns in `cache_dir` when they are mapped."""
        whole = self.whole()

        def compute() -> dict[str, np.ndarray]:
            found = whole.answer_labels(table)
            return {"labels": found.labels, "scores": found.scores, "offsets": found.offsets}

        def check(arrays: dict[str, np.ndarray]) -> None:
            labels, offsets = arrays["labels"], arrays["offsets"]
            if len(offsets) != len(whole) + 1 or offsets[0] != 0 or offsets[-1] != len(labels):
                raise ValueError("offsets that do not index its labels")
            if len(labels) and (labels.min() < 0 or labels.max() >= len(table)):
                raise ValueError(f"labels outside the table's 0..{len(table) - 1}")

        key = hashlib.sha256(json.dumps([self.key, table.answers]).encode()).hexdigest()
        arrays = cached_arrays(cache_dir if self.key else None, f"{self.KIND}-targets", key, compute, check)
        return PairAnswers(arrays["labels"], arrays["scores"], arrays["offsets"])


def soft_target(label: Mapping[str, float] | None, answers: AnswerTable) -> np.ndarray:
    """Soft-score vector over the answer table; answers outside the table are dropped (as in LXMERT)."""
    target = np.zeros(len(answers), dtype=np.float32)
    for idx, score in answers.labels(label or {}).items():
        target[idx] = score
    return target


@dataclass
class QABatch:
    """Questions `ids` column by column: token ids (B, L) right-padded, their lengths, their images'
    regions (features in the store's dtype) and soft targets (B, answers), None unless all are labelled."""

    ids: list
    token_ids: np.ndarray
    lengths: np.ndarray
    regions: PaddedRegions
    targets: np.ndarray | None

    @staticmethod
    def concat(batches: list[QABatch], pad_id: int) -> QABatch:
        """Several batches (e.g. single questions) as one, text and regions padded to the widest."""
        length = max(b.token_ids.shape[1] for b in batches)

        def pad(a: np.ndarray, width: int, value=0) -> np.ndarray:
            grow = [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
            return np.pad(a, grow, constant_values=value)

        targets = [b.targets for b in batches]
        return QABatch(
            ids=[i for b in batches for i in b.ids],
            token_ids=np.concatenate([pad(b.token_ids, length, pad_id) for b in batches]),
            lengths=np.concatenate([b.lengths for b in batches]),
            regions=PaddedRegions.concat([b.regions for b in batches]),
            targets=np.concatenate(targets) if all(t is not None for t in targets) else None,
        )


class QADataset(Dataset):
    """VQA/GQA questions read a micro-batch at a time (`__getitems__`, which DataLoader and the trainer
    call): one read transaction for the regions, questions tokenised once, soft targets scattered from
    each question's (answer, score) pairs. Item i is the batch of question i alone."""

    def __init__(
        self,
        examples: Sequence[QAExample],
        features,
        tokenizer,
        answers: AnswerTable,
        max_length: int = 20,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.examples = examples if isinstance(examples, QARows) else QARows.from_examples(examples)
        self.features = features
        self.texts = row_tokens(self.examples, "sent", tokenizer, max_length, cache_dir)
        self.pad_id = tokenizer.pad_token_id
        self.answers = answers
        self.labelled = self.examples.column("labelled")
        self.targets = self.examples.targets(answers, cache_dir)  # indexed by `base`

    def __len__(self) -> int:
        return len(self.examples)

    def request_ahead(self, indices) -> None:
        """Ask the store now for the regions of questions `indices` (`FeatureReader.request_ahead`)."""
        self.features.request_ahead(self.examples.image_ids(np.asarray(indices, dtype=np.int64)))

    def __getitems__(self, indices) -> QABatch:
        idx = np.asarray(indices, dtype=np.int64)
        targets = None
        if self.labelled[idx].all():
            targets = np.zeros((len(idx), len(self.answers)), dtype=np.float32)
            cols, scores = self.targets.gather(self.examples.base(idx))
            rows = np.broadcast_to(np.arange(len(idx))[:, None], cols.shape)
            real = cols >= 0
            targets[rows[real], cols[real]] = scores[real]
        return QABatch(
            ids=self.examples.keys(idx),
            token_ids=self.texts.padded(idx, self.pad_id),
            lengths=self.texts.lengths(idx),
            regions=read_regions(self.features, self.examples.image_ids(idx)),
            targets=targets,
        )

    def __getitem__(self, i: int) -> QABatch:
        return self.__getitems__([i])


def collate_qa(batch: QABatch | list[QABatch], pad_id: int = 0) -> dict:
    """Model inputs of a QA batch (or of a list of them, joined): padded text, regions padded to the
    batch's largest set (features as stored, widened on the device), soft targets if all are labelled."""
    if isinstance(batch, list):
        batch = QABatch.concat(batch, pad_id)
    ids = torch.from_numpy(batch.token_ids)
    attention = np.arange(batch.token_ids.shape[1])[None, :] < batch.lengths[:, None]
    out = {
        "input_ids": ids,
        "attention_mask": torch.from_numpy(attention.astype(np.int64)),
        "token_type_ids": torch.zeros_like(ids),
        **batch.regions.model_inputs(),
        "ids": batch.ids,
    }
    if batch.targets is not None:
        out["labels"] = torch.from_numpy(batch.targets)
    return out
