"""The official VQA release's file pairs (`v2_OpenEnded_mscoco_train2014_questions.json` with
`v2_mscoco_train2014_annotations.json`, and v1's names without `v2_`): questions joined to their ten human
answers by question_id, each image named as LXMERT and the COCO folders name it
(`COCO_train2014_000000458752`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.data.answers import normalize_answer
from pipelines.data.row_files import Row, RowFileError

# The release's names: the annotations of a questions file sit beside it under this name.
QUESTIONS_NAME = re.compile(r"^(?P<v>v2_)?OpenEnded_(?P<type>[a-z]+)_(?P<subtype>\w+?)_questions\.json$")
MARKER = '"data_subtype"'  # every official file has it at the top level; other row files almost never


def annotations_beside(questions: Path) -> Path | None:
    """The annotations file the release ships beside `questions`, when it is there."""
    m = QUESTIONS_NAME.match(questions.name)
    if m is None:
        return None
    path = questions.with_name(f"{m['v'] or ''}{m['type']}_{m['subtype']}_annotations.json")
    return path if path.is_file() else None


def _load_official(path: Path) -> dict | None:
    """The parsed file when it is an official questions or annotations file; None for other row files."""
    if path.suffix.lower() != ".json" or not path.is_file():
        return None
    with path.open("rb") as f:
        head = f.read(1 << 16).lstrip()
    if not head.startswith(b"{"):
        return None
    text = path.read_text(encoding="utf-8-sig")
    if MARKER not in text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None  # read_row_file says where it is broken
    if isinstance(data, dict) and ("questions" in data or "annotations" in data) and "data_subtype" in data:
        return data
    return None


def image_name(data: dict, image_id: object) -> object:
    """COCO's file stem for a numeric image id (`COCO_val2014_000000000042`); other ids as they are."""
    if data.get("data_type") == "mscoco" and isinstance(image_id, int) and not isinstance(image_id, bool):
        return f"COCO_{data['data_subtype']}_{image_id:012d}"
    return image_id


@dataclass
class OfficialVQA:
    """The official files among a run's question files: which are questions, which annotations, and the
    answers of every annotated question."""

    questions: dict[Path, dict] = field(default_factory=dict)
    annotations: dict[Path, dict] = field(default_factory=dict)

    @classmethod
    def among(cls, paths: list[Path]) -> OfficialVQA:
        """Read the official files of `paths`, adding the annotations beside a questions file given alone;
        RowFileError for annotations given without their questions."""
        found = cls()
        for path in paths:
            data = _load_official(path)
            if data is None:
                continue
            target = found.questions if "questions" in data else found.annotations
            target[path] = data
        for path, questions in list(found.questions.items()):
            beside = annotations_beside(path)
            if beside is not None and questions["data_subtype"] not in found.subtypes():
                data = _load_official(beside)
                if data is not None and "annotations" in data:
                    found.annotations[beside] = data
        if found.annotations and not found.questions:
            names = ", ".join(str(p) for p in found.annotations)
            raise RowFileError(
                f"{names}: VQA annotations without their questions file; give both "
                "(e.g. --train v2_OpenEnded_mscoco_train2014_questions.json "
                "v2_mscoco_train2014_annotations.json)"
            )
        return found

    def subtypes(self) -> set[str]:
        """The splits (`train2014`, ...) whose annotations are among the files."""
        return {data["data_subtype"] for data in self.annotations.values()}

    def rows(self, path: Path) -> list[Row]:
        """The questions of the official file `path` as rows, with the answers, answer type and question
        type of their annotations (none: an unlabelled split such as test2015)."""
        data = self.questions[path]
        items = data["questions"]
        if not isinstance(items, list):
            raise RowFileError(f"{path}: 'questions' is not a list; give the release's questions file")
        answered = {}
        for ann in self.annotations.values():
            for a in ann.get("annotations") or []:
                if isinstance(a, dict) and "question_id" in a:
                    answered[a["question_id"]] = a
        rows = []
        for i, q in enumerate(items, 1):
            if not isinstance(q, dict):
                rows.append(Row({"question": q}, None, i))
                continue
            fields = {
                "question_id": q.get("question_id"),
                "image": image_name(data, q.get("image_id")),
                "question": q.get("question"),
            }
            a = answered.get(q.get("question_id"))
            if a is not None:
                fields["answers"] = [
                    normalize_answer(x["answer"])
                    if isinstance(x, dict) and isinstance(x.get("answer"), str)
                    else x
                    for x in a.get("answers") or []
                ]
                fields["answer_type"] = a.get("answer_type")
                fields["question_type"] = a.get("question_type")
            rows.append(Row(fields, None, i))
        asked = {q.get("question_id") for q in items if isinstance(q, dict)}
        if data["data_subtype"] in self.subtypes() and not answered.keys() & asked:
            raise RowFileError(
                f"{path}: none of its questions is in {', '.join(map(str, self.annotations))}; "
                "give the annotations of the same split"
            )
        return rows
