"""Answer normalisation and the answer table (answer <-> label index) shared by pre-training and QA."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

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
    """An ordered list of normalised answers; an answer's label is its position."""

    def __init__(self, answers: Iterable[str]):
        self.answers = list(answers)
        self._index = {a: i for i, a in enumerate(self.answers)}
        if len(self._index) != len(self.answers):
            dup = [a for a, n in Counter(self.answers).items() if n > 1][:5]
            raise ValueError(f"answer table lists some answers twice, e.g. {dup}")

    @classmethod
    def build(
        cls, labels: Iterable[Mapping[str, float]], min_count: int = 1, max_size: int | None = None
    ) -> AnswerTable:
        """Answers seen in at least `min_count` label dicts, most frequent first (ties alphabetical)."""
        counts: Counter[str] = Counter()
        for label in labels:
            counts.update({normalize_answer(a) for a in label})
        counts.pop("", None)
        kept = sorted((a for a, n in counts.items() if n >= min_count), key=lambda a: (-counts[a], a))
        return cls(kept[:max_size] if max_size is not None else kept)

    @classmethod
    def load(cls, path: str | Path) -> AnswerTable:
        """An `ans2label` dict ({answer: index}, trainval_ans2label.json) or a `label2ans` list."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if isinstance(data, list) and all(isinstance(a, str) for a in data):
            return cls(data)
        if isinstance(data, dict) and all(isinstance(i, int) for i in data.values()):
            if sorted(data.values()) != list(range(len(data))):
                raise ValueError(f"{path}: ans2label indices must be 0..{len(data) - 1}, each once")
            return cls(sorted(data, key=data.__getitem__))
        raise ValueError(
            f"{path}: expected an ans2label object {{answer: index}} or a label2ans list of answers"
        )

    def save(self, path: str | Path) -> None:
        """Write the `ans2label` form ({answer: index}), which `load` reads back."""
        Path(path).write_text(json.dumps(self._index, indent=0, ensure_ascii=False))

    def __len__(self) -> int:
        return len(self.answers)

    def __contains__(self, answer: object) -> bool:
        return isinstance(answer, str) and normalize_answer(answer) in self._index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnswerTable) and self.answers == other.answers

    def index(self, answer: str) -> int:
        """The label of `answer` (normalised first); KeyError when absent."""
        return self._index[normalize_answer(answer)]

    def get(self, answer: str, default: int | None = None) -> int | None:
        return self._index.get(normalize_answer(answer), default)

    def answer(self, label: int) -> str:
        return self.answers[label]

    def labels(self, label: Mapping[str, float]) -> dict[int, float]:
        """{answer: score} -> {label index: score} for the answers in the table (best score on clashes)."""
        out: dict[int, float] = {}
        for ans, score in label.items():
            i = self._index.get(normalize_answer(ans))
            if i is not None:
                out[i] = max(out.get(i, 0.0), float(score))
        return out
