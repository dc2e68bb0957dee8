"""HF `datasets` exports (Parquet, Arrow, `save_to_disk` folders) read through the `datasets` library give
the same questions as the JSON file of the same rows, and an unusable export is one clear error."""

from __future__ import annotations

import json

import pytest

from pipelines.data.qa import load_qa_examples
from pipelines.data.row_files import RowFileError, read_row_file

datasets = pytest.importorskip("datasets")

ROWS = [
    {"image": "trip/a.jpg", "question": "what colour is the car?", "answers": ["red", "red", "dark red"]},
    {"image": "b.png", "question": "how many dogs?", "answers": ["2", "2", "2", "2", "3"]},
    {"image": "c", "question": "is it raining?", "answers": ["no"]},
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    data = datasets.Dataset.from_list(ROWS)
    data.to_parquet(str(root / "q.parquet"))
    data.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": data, "validation": data}).save_to_disk(str(root / "dict"))
    (root / "q.json").write_text(json.dumps(ROWS))
    return root


def _as_tuples(examples):
    return [(e.question_id, e.img_id, e.sent, e.label) for e in examples]


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "arrow"])
def test_exports_give_the_json_files_questions(exports, kind):
    path = {
        "parquet": exports / "q.parquet",
        "save_to_disk": exports / "saved",
        "arrow": next((exports / "saved").glob("*.arrow")),
    }[kind]
    rows = read_row_file(path)
    assert [r.fields for r in rows] == ROWS
    assert [r.where for r in rows] == ["row 1", "row 2", "row 3"]
    got = load_qa_examples([path])
    assert _as_tuples(got) == _as_tuples(load_qa_examples([exports / "q.json"]))
    # VQA's soft scores, from the counts: 2 of "red" → 0.6, 4 of "2" → 1.0
    assert got[0].label == {"red": pytest.approx(0.6), "dark red": pytest.approx(0.3)}
    assert got[1].label == {"2": 1.0, "3": pytest.approx(0.3)}


def test_an_image_column_gives_the_pictures_paths_not_pixels(tmp_path):
    from PIL import Image

    pictures = []
    for name in ("x.png", "y.png"):
        Image.new("RGB", (4, 4), "red").save(tmp_path / name)
        pictures.append(str(tmp_path / name))
    data = datasets.Dataset.from_dict(
        {"image": pictures, "question": ["q1?", "q2?"], "answer": ["red", "red"]}
    ).cast_column("image", datasets.Image())
    data.to_parquet(str(tmp_path / "with_images.parquet"))
    examples = load_qa_examples([tmp_path / "with_images.parquet"])
    assert [e.img_id for e in examples] == pictures


def test_a_dataset_dict_names_a_split_to_give(exports):
    with pytest.raises(RowFileError, match=r"DatasetDict with splits \['train', 'validation'\]"):
        read_row_file(exports / "dict")


def test_a_broken_parquet_file_is_one_error_naming_it(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(RowFileError) as exc:
        read_row_file(path)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)


def test_malformed_rows_of_an_export_are_listed_together(tmp_path):
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list(
        [{"image": "a.jpg", "text": "hi"}, {"image": "b.jpg", "text": "ho"}]
    ).to_parquet(str(path))
    with pytest.raises(RowFileError) as exc:
        load_qa_examples([path])
    assert "row 1: no 'question'" in str(exc.value) and "row 2: no 'question'" in str(exc.value)
