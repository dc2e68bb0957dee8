"""`xmodal score`: official files in, the official numbers out (hand-computed here), bad input refused."""

from __future__ import annotations

import json
import re

import pytest

from pipelines.cli import main as xmodal


def _json(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def _run(capsys, *argv):
    rc = xmodal(["score", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_vqa_against_the_official_annotations(tmp_path, capsys):
    def ann(qid, humans, answer_type, question_type):
        answers = [
            {"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(humans)
        ]
        return {
            "question_id": qid,
            "answers": answers,
            "answer_type": answer_type,
            "question_type": question_type,
        }

    gold = _json(
        tmp_path / "annotations.json",
        {
            "annotations": [
                ann(1, ["yes"] * 10, "yes/no", "is the"),
                ann(2, ["2"] * 2 + ["3"] * 8, "number", "how many"),
                ann(3, ["dog"] * 10, "other", "what is"),
            ]
        },
    )
    preds = _json(
        tmp_path / "preds.json",
        [
            {"question_id": 1, "answer": "Yes."},
            {"question_id": 2, "answer": "two"},
            {"question_id": 3, "answer": "a cat"},
        ],
    )
    rc, out, _ = _run(capsys, "vqa", preds, "--gold", gold, "--evaluator", "2017", "--json")
    assert rc == 0
    scores = json.loads(out)
    # 2017: q1: "Yes." normalises to "yes" -> 1; q2: "two" -> "2", 2 of 10 humans: the 10 leave-one-out
    # subsets give 1/3 (the 2 held-out matches) or 2/3 (the 8 others) -> 0.6; q3: 0
    assert scores["accuracy"] == round(100 * (1 + 0.6 + 0) / 3, 2)
    assert scores["per_answer_type"] == {"yes/no": 100.0, "number": 60.0, "other": 0.0}
    assert scores["per_question_type"]["how many"] == 60.0
    assert (scores["method"], scores["evaluator"]) == ("official", "vqaEval.py 2017")
    rc, out, _ = _run(capsys, "vqa", preds, "--gold", gold, "--evaluator", "2017")
    assert rc == 0 and "accuracy: 53.33" in out and "  number: 60.00" in out
    assert "evaluator: vqaEval.py 2017" in out
    # 2021 (the default): q1's humans agree, so "Yes." is compared as it is -> 0; q2 as before -> 0.6
    for argv in ((), ("--evaluator", "2021")):
        rc, out, _ = _run(capsys, "vqa", preds, "--gold", gold, *argv, "--json")
        scores = json.loads(out)
        assert rc == 0 and scores["evaluator"] == "vqaEval.py 2021"
        assert scores["accuracy"] == round(100 * (0 + 0.6 + 0) / 3, 2)


def test_gqa_exact_match_with_the_official_breakdowns(tmp_path, capsys):
    gold = _json(
        tmp_path / "balanced.json",
        {
            "q1": {
                "answer": "gray",
                "isBalanced": True,
                "types": {"structural": "query", "semantic": "attr"},
            },
            "q2": {"answer": "yes", "isBalanced": True, "types": {"structural": "verify", "semantic": "rel"}},
            "q3": {"answer": "man", "isBalanced": True, "types": {"structural": "query", "semantic": "obj"}},
            "q4": {"answer": "no", "isBalanced": False, "types": {"structural": "verify", "semantic": "rel"}},
        },
    )
    preds = [("q1", "grey"), ("q2", "yes"), ("q3", "man"), ("q4", "yes")]
    path = _json(tmp_path / "preds.json", [{"questionId": q, "prediction": p} for q, p in preds])
    rc, out, _ = _run(capsys, "gqa", path, "--gold", gold, "--json")
    scores = json.loads(out)
    assert rc == 0
    # grey is not gray; the unbalanced q4 is not counted
    assert (scores["accuracy"], scores["binary"], scores["open"], scores["questions"]) == (
        66.67,
        100.0,
        50.0,
        3,
    )
    assert scores["per_semantic_type"] == {"attr": 0.0, "obj": 100.0, "rel": 100.0}


def test_nlvr2_csv_against_the_official_json_lines(tmp_path, capsys):
    labels = {"dev-1-0-0": "True", "dev-1-1-0": "False", "dev-2-0-1": "True"}
    gold = tmp_path / "dev.json"
    gold.write_text("".join(json.dumps({"identifier": i, "label": y}) + "\n" for i, y in labels.items()))
    preds = tmp_path / "preds.csv"
    preds.write_text("dev-1-0-0,True\ndev-1-1-0,True\ndev-2-0-1,true\n")
    rc, out, _ = _run(capsys, "nlvr2", str(preds), "--gold", str(gold), "--json")
    scores = json.loads(out)
    assert rc == 0
    assert (scores["accuracy"], scores["consistency"]) == (
        66.67,
        50.0,
    )  # sentence dev-1--0 has one wrong pair


def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys):
    gold = _json(tmp_path / "gold.json", [{"question_id": 1, "label": {"yes": 1.0}}])
    missing = _json(tmp_path / "empty.json", [])
    rc, out, err = _run(capsys, "vqa", missing, "--gold", gold)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "1 questions" in err and "no prediction" in err
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    rc, _, err = _run(capsys, "vqa", str(broken), "--gold", gold)
    assert rc == 1 and str(broken) in err and "not valid JSON" in err
    rc, _, err = _run(capsys, "gqa", missing, "--gold", gold, "--questions", gold)
    assert rc == 1 and "give it as --gold" in err
    rc, _, err = _run(capsys, "gqa", missing, "--gold", gold, "--evaluator", "2017")
    assert rc == 1 and err.count("\n") == 1 and "not an evaluator of gqa" in err
    with pytest.raises(SystemExit) as exit_info:
        xmodal(["score", "pretrain", missing, "--gold", gold])
    assert exit_info.value.code == 1


def _coco_references(tmp_path):
    images = [{"id": i, "file_name": f"COCO_val2014_{i:012d}.jpg"} for i in (1, 2, 3)]
    refs = {
        1: ["a dog runs on the grass", "a brown dog running on grass"],
        2: ["a man rides a red bike", "a person riding a bicycle"],
        3: ["two cats sleep on a sofa", "cats sleeping on a couch"],
    }
    annotations = [
        {"id": 10 * i + k, "image_id": i, "caption": c}
        for i, caps in refs.items()
        for k, c in enumerate(caps)
    ]
    return _json(tmp_path / "captions_val2014.json", {"images": images, "annotations": annotations}), refs


def test_caption_results_score_as_pycocoevalcap_does(tmp_path, capsys, monkeypatch):
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    from pipelines.scoring.captions import simple_tokenize

    # without Java (fast here; the PTB path is tests/pipelines/scoring/test_captions.py's)
    monkeypatch.setattr("pipelines.scoring.captions.java_available", lambda: False)
    gold, refs = _coco_references(tmp_path)
    # two of the three images captioned: as the COCO evaluation, the results' images are scored
    results = [{"image_id": 1, "caption": "A dog runs on the grass."}, {"image_id": 2, "caption": "a cat"}]
    preds = _json(tmp_path / "captions_results.json", results)
    rc, out, err = _run(capsys, "caption", preds, "--gold", gold, "--json")
    assert rc == 0, err
    scores = json.loads(out)
    # the independent path: pycocoevalcap's scorers on the same tokens
    gts = {i: [simple_tokenize(c) for c in refs[i]] for i in (1, 2)}
    res = {r["image_id"]: [simple_tokenize(r["caption"])] for r in results}
    assert scores["CIDEr"] == pytest.approx(100 * Cider().compute_score(gts, res)[0])
    assert scores["Bleu_1"] == pytest.approx(100 * Bleu(4).compute_score(gts, res, verbose=0)[0][0])
    assert scores["images"] == 2 and scores["CIDEr"] > 0
    assert "java not found" in scores["skipped"]["METEOR"]
    rc, out, _ = _run(capsys, "caption", preds, "--gold", gold)
    assert rc == 0 and f"CIDEr: {scores['CIDEr']:.2f}" in out and "  METEOR: java not found" in out


def test_caption_references_whose_images_have_only_ids(tmp_path, capsys, monkeypatch):
    """pycocotools indexes `images` by 'id' alone (COCO.createIndex, COCO.loadRes), so pycocoevalcap
    scores a reference file without 'file_name'; `score caption` gives it the same numbers."""
    from pycocotools.coco import COCO

    monkeypatch.setattr("pipelines.scoring.captions.java_available", lambda: False)
    gold, _ = _coco_references(tmp_path)
    with open(gold) as f:
        data = json.load(f)
    data["images"] = [{"id": image["id"]} for image in data["images"]]
    bare = _json(tmp_path / "ids_only.json", data)
    preds = _json(tmp_path / "res.json", [{"image_id": 1, "caption": "a dog on the grass"}])
    COCO(bare).loadRes(preds)  # the official tool takes both files
    capsys.readouterr()  # what it printed
    rc, out, err = _run(capsys, "caption", preds, "--gold", bare, "--json")
    assert rc == 0, err
    assert json.loads(out) == json.loads(_run(capsys, "caption", preds, "--gold", gold, "--json")[1])
    data["images"] = [{"file_name": "x.jpg"}]
    rc, _, err = _run(capsys, "caption", preds, "--gold", _json(tmp_path / "no_id.json", data))
    assert rc == 1 and "images[0] needs an 'id'" in err


@pytest.mark.parametrize(
    ("results", "match"),
    [
        ([{"image_id": 9, "caption": "x"}], r"1 captioned images have no references in .* \(e.g. 9\)"),
        ([{"image_id": 1, "caption": "x"}, {"image_id": 1, "caption": "y"}], "row 1: image 1 has a second"),
        ([{"image_id": "1", "caption": "x"}], "row 0: 'image_id' is '1', not an integer"),
        ([], "no captions to score"),
    ],
)
def test_bad_caption_results_are_one_line_errors(tmp_path, capsys, results, match):
    gold, _ = _coco_references(tmp_path)
    preds = _json(tmp_path / "res.json", results)
    rc, out, err = _run(capsys, "caption", preds, "--gold", gold)
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert re.search(match, err), err


def _retrieval_gold(tmp_path):
    rows = [{"img_id": f"img{i}", "sentences": [f"caption {i} a", f"caption {i} b"]} for i in range(12)]
    return _json(tmp_path / "test.json", rows)


def test_retrieval_rankings_score_recall_at_k(tmp_path, capsys):
    gold = _retrieval_gold(tmp_path)
    images = [f"img{i}" for i in range(12)]
    rankings = []
    for i in range(12):
        for k in range(2):
            # caption i#k ranks its own image at position (i % 6) * 2 + 1 (1, 3, 5, ..., 11)
            others = [img for img in images if img != f"img{i}"]
            position = (i % 6) * 2
            ranked = others[:position] + [f"img{i}"] + others[position:]
            rankings.append({"caption_id": f"img{i}#{k}", "images": ranked[:10]})
    preds = _json(tmp_path / "rankings.json", rankings)
    rc, out, err = _run(capsys, "retrieval", preds, "--gold", gold, "--json")
    assert rc == 0, err
    scores = json.loads(out)
    # own ranks 1, 3, 5, 7, 9, 11 equally often: R@1 1/6, R@5 3/6, R@10 5/6 (rank 11 is not listed)
    assert scores["R@1"] == pytest.approx(100 / 6)
    assert scores["R@5"] == pytest.approx(50.0)
    assert scores["R@10"] == pytest.approx(500 / 6)
    assert (scores["captions"], scores["images"]) == (24, 12)


def test_retrieval_rankings_that_cannot_be_scored_are_refused(tmp_path, capsys):
    gold = _retrieval_gold(tmp_path)
    short = [{"caption_id": f"img{i}#{k}", "images": ["img99"]} for i in range(12) for k in range(2)]
    rc, _, err = _run(capsys, "retrieval", _json(tmp_path / "short.json", short), "--gold", gold)
    assert rc == 1 and err.count("\n") == 1 and "ranks 1 images without its own" in err
    partial = [{"caption_id": "img0#0", "images": ["img0"]}]
    rc, _, err = _run(capsys, "retrieval", _json(tmp_path / "partial.json", partial), "--gold", gold)
    assert rc == 1 and "23 captions" in err and "no prediction" in err
    broken = tmp_path / "broken.json"
    broken.write_text('[{"caption_id": "img0#0", "images": "img0"}]')
    rc, _, err = _run(capsys, "retrieval", str(broken), "--gold", gold)
    assert rc == 1 and str(broken) in err and "'images' is 'img0', not a list" in err
