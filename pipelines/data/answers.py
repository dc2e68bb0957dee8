"""Answer normalisation and the answer table (answer <-> label index) shared by pre-training and QA."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from model.files import read_json

ANSWERS_FILE = "ans2label.json"  # the table beside a pre-trained or fine-tuned model

# The release's conversions (lxmert `AnswerTable.ANS_CONVERT`): whole answers only.
_CONVERT = {
    "a man": "man",
    "the man": "man",
    "a woman": "woman",
    "the woman": "woman",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
    "grey": "gray",
}


def normalize_answer(answer: str) -> str:
    """Lowercase, strip a trailing ".", a leading "a "/"an "/"the ", then number words -> digits."""
    ans = answer.strip().lower()
    if ans.endswith("."):
        ans = ans[:-1].strip()
    for article in ("a ", "an ", "the "):
        if ans.startswith(article):
            ans = ans[len(article) :].strip()
    return _CONVERT.get(ans, ans)


class AnswerTable:
    """An ordered list of answers; an answer's label is its position.

    A built table holds normalised answers; a loaded one keeps the file's answers and order as they are
    (the order fixes the rows of a trained head). An answer is looked up as given first, then normalised
    against the table's answers as given, then against the table's answers normalised, so "Two" finds a
    table's "2" and "2" finds a table that only lists "two"."""

    def __init__(self, answers: Iterable[str]):
        self.answers = list(answers)
        self._index = {a: i for i, a in enumerate(self.answers)}
        if len(self._index) != len(self.answers):
            dup = [a for a, n in Counter(self.answers).items() if n > 1][:5]
            raise ValueError(f"answer table lists some answers twice, e.g. {dup}")
        # table answers that only match once normalised; when several normalise alike, the first row wins
        self._normalised: dict[str, int] = {}
        for i, a in enumerate(self.answers):
            self._normalised.setdefault(normalize_answer(a), i)

    @classmethod
    def build(
        cls, labels: Iterable[Mapping[str, float]], min_count: int = 1, max_size: int | None = None
    ) -> AnswerTable:
        """Answers seen in at least `min_count` label dicts, most frequent first (ties alphabetical)."""
        counts: Counter[str] = Counter()
        for label in labels:
            counts.update({normalize_answer(a) for a in label})
        return cls.from_counts(counts, min_count, max_size)

    @classmethod
    def from_counts(
        cls, counts: Mapping[str, int], min_count: int = 1, max_size: int | None = None
    ) -> AnswerTable:
        """Answers counted (normalised answer -> label dicts naming it) in at least `min_count` dicts, most
        frequent first (ties alphabetical)."""
        counts = {a: n for a, n in counts.items() if a}
        kept = sorted((a for a, n in counts.items() if n >= min_count), key=lambda a: (-counts[a], a))
        return cls(kept[:max_size] if max_size is not None else kept)

    @classmethod
    def load(cls, path: str | Path) -> AnswerTable:
        """An `ans2label` dict ({answer: index}, trainval_ans2label.json), a `label2ans` list, or the
        release's `all_ans.json` (a list of {"ans": answer, "dsets": [...]}; its order is the
        pre-training QA head's, 9500 rows for Epoch20_LXRT.pth)."""
        path = Path(path)
        try:
            data = read_json(path, "answer table")
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        if isinstance(data, list) and all(isinstance(a, str) for a in data):
            return cls._from_file(data, path)
        if isinstance(data, list) and all(isinstance(a, dict) for a in data):
            bad = next((i for i, a in enumerate(data) if not isinstance(a.get("ans"), str)), None)
            if bad is not None:
                raise ValueError(
                    f"{path}: entry {bad} has no string 'ans'; expected all_ans.json's "
                    '[{"ans": answer, "dsets": [...]}, ...]'
                )
            return cls._from_file([a["ans"] for a in data], path)
        if isinstance(data, dict) and all(isinstance(i, int) for i in data.values()):
            if sorted(data.values()) != list(range(len(data))):
                raise ValueError(f"{path}: ans2label indices must be 0..{len(data) - 1}, each once")
            return cls._from_file(sorted(data, key=data.__getitem__), path)
        raise ValueError(
            f"{path}: expected an ans2label object {{answer: index}}, a label2ans list of answers, "
            'or all_ans.json\'s list of {"ans": answer, "dsets": [...]}'
        )

    @classmethod
    def _from_file(cls, answers: list[str], path: Path) -> AnswerTable:
        try:
            return cls(answers)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write the `ans2label` form ({answer: index}), which `load` reads back."""
        Path(path).write_text(json.dumps(self._index, indent=0, ensure_ascii=False))

    def __len__(self) -> int:
        return len(self.answers)

    def __contains__(self, answer: object) -> bool:
        return isinstance(answer, str) and self.get(answer) is not None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnswerTable) and self.answers == other.answers

    def index(self, answer: str) -> int:
        """The label of `answer` (see the class docstring for the lookup); KeyError when absent."""
        label = self.get(answer)
        if label is None:
            raise KeyError(answer)
        return label

    def get(self, answer: str, default: int | None = None) -> int | None:
        label = self._index.get(answer)
        if label is None:
            norm = normalize_answer(answer)
            label = self._index.get(norm)
            if label is None:
                label = self._normalised.get(norm)
        return default if label is None else label

    def answer(self, label: int) -> str:
        return self.answers[label]

    def labels(self, label: Mapping[str, float]) -> dict[int, float]:
        """{answer: score} -> {label index: score} for the answers in the table (best score on clashes)."""
        out: dict[int, float] = {}
        for ans, score in label.items():
            i = self.get(ans)
            if i is not None:
                out[i] = max(out.get(i, 0.0), float(score))
        return out


# ---- answers of many rows as flat columns: each row's (answer id, score) entries back to back
ROWS_STEP = 1 << 20  # rows whose answers are sorted together


def flat_entries(
    offsets: np.ndarray, ids: np.ndarray, scores: np.ndarray, rows: np.ndarray | None, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every answer entry of selected rows lo..hi-1 of flat answer columns (`rows`: the selection, None:
    all rows): (row index - lo, answer id, score)."""
    if rows is None:  # consecutive entries: slices of the columns
        bounds = np.asarray(offsets[lo : hi + 1], dtype=np.int64)
        pairs = np.repeat(np.arange(hi - lo, dtype=np.int64), np.diff(bounds))
        first, last = int(bounds[0]), int(bounds[-1])
        return pairs, ids[first:last], scores[first:last]
    at = rows[lo:hi]
    start, stop = offsets[at], offsets[at + 1]
    counts = stop - start
    pairs = np.repeat(np.arange(hi - lo, dtype=np.int64), counts)
    starts = np.repeat(start - (np.cumsum(counts) - counts), counts)
    entry = starts + np.arange(int(counts.sum()), dtype=np.int64)
    return pairs, np.asarray(ids[entry]), np.asarray(scores[entry])


Entries = Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def answer_counts(
    names: list[str], entries: Entries, rows: int, normalize, step: int = ROWS_STEP
) -> Counter[str]:
    """For each answer of `names` as `normalize` gives it, the number of rows whose `entries(lo, hi)`
    (`flat_entries`) list it; `step` rows at a time."""
    norm_names: dict[str, int] = {}
    norm_of = np.array([norm_names.setdefault(normalize(a), len(norm_names)) for a in names], np.int64)
    width = max(len(norm_names), 1)
    counts = np.zeros(width, np.int64)
    for lo in range(0, rows, step):
        pairs, ids, _ = entries(lo, min(lo + step, rows))
        if not len(ids):
            continue
        keys = np.sort(pairs * width + norm_of[ids])  # np.unique hashes: 20x slower
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
        counts += np.bincount(keys % width, minlength=width)
    found = list(norm_names)
    return Counter({found[k]: int(n) for k, n in enumerate(counts.tolist()) if n})


def answer_labels(
    names: list[str], entries: Entries, rows: int, table: AnswerTable, step: int = ROWS_STEP
) -> PairAnswers:
    """Each row's answers (`entries(lo, hi)` over answers `names`) as labels of `table`, as
    `AnswerTable.labels` gives them: answers not in the table left out, the best score, at least 0, for
    answers sharing a label; flat. Made `step` rows at a time: the sorts' scratch arrays stay small
    whatever the number of rows."""
    lookup = np.array([table.get(a, -1) for a in names] or [-1], dtype=np.int64)
    counts = np.zeros(rows, np.int64)
    out_labels, out_scores = [], []
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        pairs, ids, scores = entries(lo, hi)
        labels = lookup[ids] if len(ids) else np.zeros(0, np.int64)
        known = labels >= 0
        pairs, labels, scores = pairs[known], labels[known], np.asarray(scores)[known]
        position = np.arange(len(pairs))
        # group each row's entries by label: first position and best score per group
        order = np.lexsort((position, labels, pairs))
        pairs, labels, scores, position = pairs[order], labels[order], scores[order], position[order]
        start = np.ones(len(pairs), bool)
        start[1:] = (pairs[1:] != pairs[:-1]) | (labels[1:] != labels[:-1])
        starts = np.nonzero(start)[0]
        best = np.maximum(np.maximum.reduceat(scores, starts), 0.0) if starts.size else scores[:0]
        g_pairs, g_labels, g_first = pairs[starts], labels[starts], position[starts]
        keep = np.lexsort((g_first, g_pairs))
        out_labels.append(g_labels[keep].astype(np.int64))
        out_scores.append(best[keep].astype(np.float32))
        counts[lo:hi] = np.bincount(g_pairs, minlength=hi - lo)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    labels = np.concatenate(out_labels) if out_labels else np.zeros(0, np.int64)
    scores = np.concatenate(out_scores) if out_scores else np.zeros(0, np.float32)
    return PairAnswers(labels, scores, offsets)


class PairAnswers:
    """Each pair's (label, soft score) answers, flat with offsets; `gather` gives a batch's (B, K) arrays,
    K the most answers any pair has (at least 1)."""

    def __init__(self, labels: np.ndarray, scores: np.ndarray, offsets: np.ndarray):
        self.labels, self.scores, self.offsets = labels, scores, offsets
        counts = np.diff(offsets)
        self.width = max(1, int(counts.max(initial=0)))

    @classmethod
    def from_lists(cls, answers: Sequence[Sequence[tuple[int, float]]]) -> PairAnswers:
        counts = np.array([len(a) for a in answers], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        labels = np.array([label for a in answers for label, _ in a], dtype=np.int64)
        scores = np.array([score for a in answers for _, score in a], dtype=np.float32)
        return cls(labels, scores, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, K) int64 labels (-100 pads) and float32 soft scores of pairs `indices`."""
        lo = self.offsets[indices]
        counts = self.offsets[indices + 1] - lo
        inside = np.arange(self.width)[None, :] < counts[:, None]
        at = np.minimum(lo[:, None] + np.arange(self.width)[None, :], max(len(self.labels) - 1, 0))
        if not len(self.labels):
            return np.full(inside.shape, -100, np.int64), np.zeros(inside.shape, np.float32)
        return (
            np.where(inside, self.labels[at], -100).astype(np.int64),
            np.where(inside, self.scores[at], 0.0).astype(np.float32),
        )
