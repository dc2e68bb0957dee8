"""Evaluation: prediction files in the official formats, and `xmodal evaluate` on a fine-tuned run."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from pipelines.apps.evaluate import evaluate
from pipelines.cli import main
from pipelines.tasks import TASKS, get_finetune_task
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task
from storage import FeatureReader, FeatureWriter, RegionFeatures


def test_vqa_file_is_list_of_question_id_answer(tmp_path):
    path = TASKS["vqa"].write_predictions(tmp_path / "vqa.json", {458752000: "net", 262148000: "2"})
    rows = json.loads(path.read_text())
    assert rows == [{"question_id": 458752000, "answer": "net"}, {"question_id": 262148000, "answer": "2"}]
    assert all(isinstance(r["question_id"], int) for r in rows)


def test_gqa_file_uses_questionId_strings(tmp_path):
    path = TASKS["gqa"].write_predictions(tmp_path / "gqa.json", {"201307251": "no", 5: "left"})
    assert json.loads(path.read_text()) == [
        {"questionId": "201307251", "prediction": "no"},
        {"questionId": "5", "prediction": "left"},
    ]


def test_nlvr2_csv_as_the_official_script_reads_it(tmp_path):
    labels = {"test1-0-1-0": 1, "test1-0-0-0": 0}
    path = TASKS["nlvr2"].write_predictions(tmp_path / "nlvr2.csv", labels)
    # the official metrics.py: line.strip().split(","), prediction compared lowercased with "true"/"false"
    parsed = {}
    for line in path.read_text().splitlines():
        ident, pred = line.strip().split(",")
        parsed[ident] = pred
    assert parsed == {"test1-0-1-0": "True", "test1-0-0-0": "False"}
    assert [r for r in csv.reader(path.open())] == [["test1-0-1-0", "True"], ["test1-0-0-0", "False"]]


def test_bad_task_and_bad_identifier(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        get_finetune_task("okvqa")
    with pytest.raises(ValueError, match="commas"):
        TASKS["nlvr2"].write_predictions(tmp_path / "x.csv", {"a,b": 1})


WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "is", "it", "red", "?", "there", "a", "dog"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Untrained fine-tuned directories for VQA and NLVR2 over a 16-d store, and their splits."""
    root = tmp_path_factory.mktemp("evaluate")
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "feats.lmdb", feature_dim=16, max_boxes=5, dtype="float32") as w:
        for i in range(6):
            n = int(rng.integers(2, 6))
            ones = np.ones(n, np.float32)
            boxes = np.tile(np.array([[1, 2, 30, 40]], np.float32), (n, 1))
            feats = rng.normal(size=(n, 16)).astype(np.float32)
            w.put(
                RegionFeatures(
                    f"i{i}", 50, 60, boxes, feats, np.zeros(n, np.int64), ones, np.zeros(n, np.int64), ones
                )
            )
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    answers = ["yes", "no", "red", "dog"]
    vqa = [
        {
            "question_id": 100 + i,
            "img_id": f"i{i}",
            "sent": "is it red?",
            "label": {answers[i % 4]: 1.0, "no": 0.3},
            "answer_type": "yes/no" if i % 2 else "other",
        }
        for i in range(6)
    ]
    # GQA: string question ids (a leading zero must survive), one answer each
    gqa = [
        {"question_id": f"0{i}1307", "img_id": f"i{i}", "sent": "is it red?", "label": {answers[i % 3]: 1.0}}
        for i in range(6)
    ]
    nlvr2 = [
        {
            "identifier": f"dev-{i // 2}-{i % 2}-0",
            "img0": f"i{i}",
            "img1": f"i{(i + 1) % 6}",
            "sent": "there is a dog",
            "label": i % 2,
        }
        for i in range(6)
    ]
    files = {"root": root, "features": root / "feats.lmdb"}
    for name, rows in (("vqa", vqa), ("gqa", gqa), ("nlvr2", nlvr2)):
        files[name] = root / f"{name}.json"
        files[name].write_text(json.dumps(rows))
        cfg = FinetuneConfig(
            task=name,
            features=[str(root / "feats.lmdb")],
            train_files=[str(files[name])],
            preset="tiny",
            vocab=str(root / "vocab.txt"),
            model={"visual_feat_dim": 16},
        )
        task = build_task(cfg)
        torch.manual_seed(0)
        model = task.build_model()
        if name == "gqa":  # answers "red" whatever it is asked, so its accuracy is known by hand
            with torch.no_grad():
                model.answer_head.classifier.bias[task.answers.index("red")] = 1e4
        task.save(model, root / f"{name}_best")
        files[f"{name}_best"] = root / f"{name}_best"
    return files


def test_evaluate_vqa_writes_official_predictions_and_matching_metrics(runs, tmp_path, capsys):
    out = tmp_path / "preds.json"
    argv = [
        "evaluate",
        "vqa",
        "--checkpoint",
        str(runs["vqa_best"]),
        "--features",
        str(runs["features"]),
        "--split",
        str(runs["vqa"]),
        "--out",
        str(out),
        "--batch-size",
        "4",
    ]
    assert main(argv) == 0
    preds = json.loads(out.read_text())
    rows = {r["question_id"]: r for r in json.loads(runs["vqa"].read_text())}
    assert sorted(p["question_id"] for p in preds) == sorted(rows)
    assert all(set(p) == {"question_id", "answer"} for p in preds)
    # independent soft accuracy from the prediction file
    scores = {p["question_id"]: rows[p["question_id"]]["label"].get(p["answer"], 0.0) for p in preds}
    metrics = json.loads((tmp_path / "preds.metrics.json").read_text())
    assert metrics["accuracy"] == pytest.approx(100 * sum(scores.values()) / len(scores), abs=0.005)
    yes_no = [s for q, s in scores.items() if rows[q]["answer_type"] == "yes/no"]
    assert metrics["accuracy/yes/no"] == pytest.approx(100 * sum(yes_no) / len(yes_no), abs=0.005)
    assert f"accuracy: {metrics['accuracy']:.2f}" in capsys.readouterr().out


def test_evaluate_gqa_writes_questionId_strings_and_exact_match_accuracy(runs, tmp_path, capsys):
    out = tmp_path / "gqa_preds.json"
    argv = ["evaluate", "gqa", "--checkpoint", str(runs["gqa_best"]), "--features", str(runs["features"])]
    argv += ["--split", str(runs["gqa"]), "--out", str(out), "--batch-size", "4"]
    assert main(argv) == 0
    rows = json.loads(runs["gqa"].read_text())
    preds = json.loads(out.read_text())
    assert isinstance(preds, list) and all(set(p) == {"questionId", "prediction"} for p in preds)
    assert all(isinstance(p["questionId"], str) and isinstance(p["prediction"], str) for p in preds)
    assert sorted(p["questionId"] for p in preds) == sorted(r["question_id"] for r in rows)
    assert {p["prediction"] for p in preds} == {"red"}
    metrics = json.loads((tmp_path / "gqa_preds.metrics.json").read_text())
    red = sum("red" in r["label"] for r in rows)
    assert red == 2 and metrics["accuracy"] == pytest.approx(100 * red / len(rows), abs=0.005)
    assert set(metrics) == {"accuracy", "loss"} and metrics["loss"] > 0
    assert f"accuracy: {metrics['accuracy']:.2f}" in capsys.readouterr().out


def test_evaluate_nlvr2_writes_the_csv_and_consistency(runs, tmp_path):
    out = tmp_path / "preds.csv"
    argv = [
        "evaluate",
        "nlvr2",
        "--checkpoint",
        str(runs["nlvr2_best"]),
        "--features",
        str(runs["features"]),
        "--split",
        str(runs["nlvr2"]),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    labels = {r["identifier"]: r["label"] for r in json.loads(runs["nlvr2"].read_text())}
    preds = dict(line.split(",") for line in out.read_text().splitlines())
    assert set(preds) == set(labels) and set(preds.values()) <= {"True", "False"}
    right = {i: (preds[i] == "True") == bool(y) for i, y in labels.items()}
    groups: dict[str, bool] = {}
    for ident, ok in right.items():
        key = ident.split("-")[1]
        groups[key] = groups.get(key, True) and ok
    metrics = json.loads((tmp_path / "preds.metrics.json").read_text())
    assert metrics["accuracy"] == pytest.approx(100 * sum(right.values()) / len(right), abs=0.005)
    assert metrics["consistency"] == pytest.approx(100 * sum(groups.values()) / len(groups), abs=0.005)


def test_unlabelled_split_gives_predictions_only(runs, tmp_path):
    test = tmp_path / "test.json"
    rows = json.loads(runs["vqa"].read_text())
    test.write_text(json.dumps([{k: v for k, v in r.items() if k != "label"} for r in rows]))
    out = tmp_path / "test_preds.json"
    metrics = evaluate(runs["vqa_best"], [runs["features"]], [test], out)
    assert metrics is None and not (tmp_path / "test_preds.metrics.json").exists()
    assert len(json.loads(out.read_text())) == len(rows)


def test_evaluate_refuses_a_task_mismatch_and_missing_images(runs, tmp_path, capsys):
    argv = [
        "evaluate",
        "gqa",
        "--checkpoint",
        str(runs["vqa_best"]),
        "--features",
        str(runs["features"]),
        "--split",
        str(runs["vqa"]),
        "--out",
        str(tmp_path / "p.json"),
    ]
    assert main(argv) == 1
    assert "fine-tuned for vqa, not gqa" in capsys.readouterr().err
    argv[1] = "vqa"
    assert main([*argv, "--beam-size", "2"]) == 1
    assert "--beam-size applies to captioners; vqa predictions are not decoded" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"question_id": 1, "img_id": "elsewhere", "sent": "is it red?"}]))
    with pytest.raises(ValueError, match="1 image ids are not in the feature store"):
        evaluate(runs["vqa_best"], [runs["features"]], [bad], tmp_path / "p.json")


@pytest.mark.parametrize("task", ["vqa", "gqa", "nlvr2"])
def test_score_of_the_written_predictions_equals_the_evaluate_metrics(runs, tmp_path, task):
    """`xmodal evaluate` (and training validation, the same function) and `xmodal score` share the code."""
    from pipelines.apps.score import score

    out = tmp_path / ("preds.csv" if task == "nlvr2" else "preds.json")
    metrics = evaluate(runs[f"{task}_best"], [runs["features"]], [runs[task]], out, task=task)
    scored = score(task, out, runs[task])
    assert scored["accuracy"] == metrics["accuracy"]
    if task == "nlvr2":
        assert scored["consistency"] == metrics["consistency"]
    if task == "vqa":
        assert scored["method"] == "lxmert-soft-labels"
        assert {f"accuracy/{k}": v for k, v in scored["per_answer_type"].items()} == {
            k: v for k, v in metrics.items() if k.startswith("accuracy/")
        }


def test_evaluate_features_refuses_a_store_extracted_unlike_the_run(runs, tmp_path, capsys):
    """Issue 44: only the feature width was compared, so a run fine-tuned on 10 boxes scored a 36-box
    store without a word. Every shard's recorded extraction is now compared with the run's."""
    import shutil

    from pipelines.tasks.finetune import RUN_FILE

    def extraction(max_boxes: int) -> dict:
        return {"features": "regions", "selection": "caffe", "min_boxes": max_boxes, "max_boxes": max_boxes,
                "feature_dim": 16, "weights": "det", "weights_sha256": "ab" * 32,
                "config": {"min_size": 160, "nms_thresh": 0.3}}  # fmt: skip

    run = tmp_path / "run"
    shutil.copytree(runs["vqa_best"], run)
    settings = json.loads((run / RUN_FILE).read_text())
    (run / RUN_FILE).write_text(json.dumps({**settings, "detector": extraction(10)}))
    source = FeatureReader(runs["features"])
    stores = {}
    for boxes in (10, 36):
        stores[boxes] = tmp_path / f"feats{boxes}.lmdb"
        with FeatureWriter(
            stores[boxes], feature_dim=16, max_boxes=5, dtype="float32", meta=extraction(boxes)
        ) as w:
            for key in list(source.keys()):
                w.put(source[key])
    source.close()
    argv = ["evaluate", "vqa", "--checkpoint", str(run), "--split", str(runs["vqa"])]
    argv += ["--out", str(tmp_path / "p.json")]
    assert main([*argv, "--features", str(stores[36])]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and str(stores[36]) in err[0] and str(run) in err[0], err
    assert "max_boxes 10 (here: 36)" in err[0] and "min_boxes 10 (here: 36)" in err[0]
    assert not (tmp_path / "p.json").exists()
    assert main([*argv, "--features", str(stores[10])]) == 0
    assert main([*argv, "--features", str(runs["features"])]) == 0  # a store that recorded nothing
