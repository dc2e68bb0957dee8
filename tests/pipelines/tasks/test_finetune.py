"""Fine-tuning on generated problems: each task learns well above chance; seeding; bad input; resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from model import LxmertConfig, LxmertForPreTraining, LxmertForQuestionAnswering
from pipelines.cli import main
from pipelines.data.answers import AnswerTable
from pipelines.engine.run_log import read_metrics
from pipelines.tasks import get_finetune_task
from pipelines.tasks.finetune import FinetuneConfig, FinetuneRun
from pipelines.tasks.finetuned import build_task, finetune, load_finetuned
from pipelines.tasks.qa import seed_answer_head
from storage import FeatureWriter, RegionFeatures

DIM = 32
COLOURS = ("red", "green", "blue")
SHAPES = ("circle", "square", "star")
WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "what",
    "color",
    "shape",
    "is",
    "the",
    "object",
    "?",
    "two",
    "objects",
    "have",
    "same",
    "a",
    ".",
    "red",
    "green",
    "blue",
    "circle",
    "square",
    "star",
    "there",
]
N_IMAGES, N_TRAIN = 160, 128
PRETRAIN_ANSWERS = ("red", "yes", "blue", "no")


pytestmark = pytest.mark.usefixtures("one_thread")


def _write_store(path: Path, rng: np.random.Generator) -> dict[str, tuple[int, int]]:
    """Images whose 3-6 regions carry a colour code (dims 0-2) and a shape code (dims 3-5) in noise."""
    truth = {}
    with FeatureWriter(path, feature_dim=DIM, max_boxes=6, dtype="float32") as w:
        for i in range(N_IMAGES):
            c, s, n = int(rng.integers(3)), int(rng.integers(3)), int(rng.integers(3, 7))
            feats = rng.normal(0.0, 0.5, (n, DIM)).astype(np.float32)
            feats[:, c] += 2.0
            feats[:, 3 + s] += 2.0
            xy = rng.uniform(0, 60, (n, 2))
            boxes = np.concatenate([xy, xy + rng.uniform(5, 40, (n, 2))], axis=1).astype(np.float32)
            img_id = f"img{i:03d}"
            ones = np.ones(n, np.float32)
            w.put(
                RegionFeatures(
                    img_id, 100, 100, boxes, feats, np.zeros(n, np.int64), ones, np.zeros(n, np.int64), ones
                )
            )
            truth[img_id] = (c, s)
    return truth


def _qa_rows(truth: dict, gqa: bool) -> tuple[list[dict], list[dict]]:
    rows = []
    for img_id, (c, s) in truth.items():
        other = COLOURS[(c + 1) % 3]
        colour_label = {COLOURS[c]: 1.0} if gqa else {COLOURS[c]: 1.0, other: 0.3}
        for sent, label in (
            ("what color is the object?", colour_label),
            ("what shape is the object?", {SHAPES[s]: 1.0}),
        ):
            qid = f"g{len(rows)}" if gqa else len(rows)
            rows.append(
                {"question_id": qid, "img_id": img_id, "sent": sent, "label": label, "answer_type": "other"}
            )
    split = [int(r["img_id"][3:]) < N_TRAIN for r in rows]
    return [r for r, t in zip(rows, split, strict=True) if t], [
        r for r, t in zip(rows, split, strict=True) if not t
    ]


def _nlvr2_rows(truth: dict, rng: np.random.Generator, ids: list[str], prefix: str) -> list[dict]:
    """ "there is a red object": true when either image is red (half of the pairs), so both images count.

    Identifiers put two image pairs under each sentence id, as NLVR2 does."""
    red = [i for i in ids if truth[i][0] == 0]
    other = [i for i in ids if truth[i][0] != 0]
    rows = []
    for k in range(len(ids)):
        label = k % 2
        if label:
            pair = [str(rng.choice(red)), str(rng.choice(ids))]
            rng.shuffle(pair)
        else:
            pair = [str(i) for i in rng.choice(other, 2, replace=False)]
        rows.append(
            {
                "identifier": f"{prefix}-{k // 2}-{k % 2}-0",
                "img0": pair[0],
                "img1": pair[1],
                "sent": "there is a red object",
                "label": label,
            }
        )
    return rows


@pytest.fixture(scope="module")
def problem(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune")
    rng = np.random.default_rng(0)
    truth = _write_store(root / "feats.lmdb", rng)
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    files = {"root": root, "features": root / "feats.lmdb", "vocab": root / "vocab.txt"}
    for task in ("vqa", "gqa"):
        train, valid = _qa_rows(truth, gqa=task == "gqa")
        for split, rows in (("train", train), ("valid", valid)):
            files[f"{task}_{split}"] = root / f"{task}_{split}.json"
            files[f"{task}_{split}"].write_text(json.dumps(rows))
    ids = sorted(truth)
    for split, chosen in (("train", ids[:N_TRAIN]), ("valid", ids[N_TRAIN:])):
        files[f"nlvr2_{split}"] = root / f"nlvr2_{split}.jsonl"
        rows = _nlvr2_rows(truth, rng, chosen, split)
        files[f"nlvr2_{split}"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a "pre-training" directory: tiny model with a 4-answer QA head, its answer table and vocab
    init = root / "pretrain_last"
    cfg = LxmertConfig.preset(
        "tiny", vocab_size=len(WORDS), visual_feat_dim=DIM, num_qa_labels=len(PRETRAIN_ANSWERS)
    )
    torch.manual_seed(0)
    LxmertForPreTraining(cfg).save_pretrained(init)
    AnswerTable(PRETRAIN_ANSWERS).save(init / "ans2label.json")
    (init / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    files["init"] = init
    return files


def _train_cfg(task: str, **kw):
    # the learning tests' rates were tuned for AdamW on this tiny problem; BertAdam has its own tests
    base = dict(lr=3e-3, batch_size=16, epochs=6, loader_workers=0, log_every=8, optimizer="adamw")
    return dataclasses.replace(get_finetune_task(task).default_train_config(), **{**base, **kw})


def _majority_accuracy(valid: Path, train: Path) -> float:
    """Accuracy of always answering the most frequent training answer (soft scores for VQA)."""
    counts: dict[str, float] = {}
    for row in json.loads(train.read_text()):
        for a, s in row["label"].items():
            counts[a] = counts.get(a, 0.0) + s
    top = max(counts, key=counts.__getitem__)
    rows = json.loads(valid.read_text())
    return 100.0 * sum(r["label"].get(top, 0.0) for r in rows) / len(rows)


def test_defaults_follow_the_spec():
    for task, lr in (("vqa", 5e-5), ("gqa", 1e-5), ("nlvr2", 5e-5)):
        cfg = get_finetune_task(task).default_train_config()
        assert (cfg.lr, cfg.batch_size, cfg.epochs, cfg.warmup_ratio, cfg.clip_norm) == (lr, 32, 4, 0.1, 5.0)
        assert (cfg.optimizer, cfg.weight_decay, cfg.decay_norm_and_bias) == ("bertadam", 0.01, True)


def _argv(problem, task: str, out, *extra: str, valid: bool = True) -> list[str]:
    """`xmodal finetune TASK` on the generated problem, from the pre-trained init, loader in-process."""
    argv = [
        "finetune",
        task,
        "--features",
        str(problem["features"]),
        "--train",
        str(problem[f"{task}_train"]),
    ]
    if valid:
        argv += ["--valid", str(problem[f"{task}_valid"])]
    extra = (*extra, "train.loader_workers=0", "train.optimizer=adamw")  # the rates are tuned for AdamW
    return [*argv, "--init", str(problem["init"]), "--out", str(out), *extra]


@pytest.mark.slow
def test_vqa_learns_through_the_cli(problem, tmp_path):
    out = tmp_path / "vqa"
    argv = _argv(
        problem, "vqa", out, "--epochs", "6", "--batch-size", "16", "--lr", "3e-3", "train.log_every=8"
    )
    assert main(argv) == 0
    rows = read_metrics(out / "metrics.jsonl")
    valid = [r for r in rows if "valid_accuracy" in r]
    assert len(valid) == 6 and all("valid_accuracy/other" in r for r in valid)
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["value"] == max(r["valid_accuracy"] for r in valid)
    # chance given the question is 33 %; the majority answer scores less still
    baseline = _majority_accuracy(problem["vqa_valid"], problem["vqa_train"])
    assert best["value"] > max(baseline, 100 / 3) + 25
    train = [r for r in rows if "loss" in r and "valid_accuracy" not in r]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]
    for d in ("best", "last"):
        tuned = load_finetuned(out / d)
        assert tuned.task == "vqa" and tuned.max_length == 20
        assert set(tuned.answers.answers) == set(COLOURS + SHAPES)
        assert len(tuned.tokenizer) == len(WORDS)
    # evaluating best/ on the validation file reproduces the accuracy that chose it
    preds = out / "preds.json"
    argv = [
        "evaluate",
        "vqa",
        "--checkpoint",
        str(out / "best"),
        "--features",
        str(problem["features"]),
        "--split",
        str(problem["vqa_valid"]),
        "--out",
        str(preds),
    ]
    assert main(argv) == 0
    assert json.loads((out / "preds.metrics.json").read_text())["accuracy"] == pytest.approx(best["value"])
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (
        saved["task"]["task"] == "vqa" and saved["train"]["lr"] == 3e-3 and saved["train"]["clip_norm"] == 5.0
    )
    assert saved["task"]["preset"] is None  # the tiny model came from --init: no "base" claimed for it


def test_a_preset_with_init_is_ignored_with_a_warning(problem, caplog):
    cfg = FinetuneConfig(
        task="gqa",
        features=[str(problem["features"])],
        train_files=[str(problem["gqa_train"])],
        init=str(problem["init"]),
        preset="base",
    )
    task = build_task(cfg)
    assert "--preset base is ignored" in caplog.text
    assert task.model_config.hidden_size == LxmertConfig.preset("tiny").hidden_size  # the init's, not base


@pytest.mark.slow
def test_gqa_learns(problem, tmp_path):
    cfg = FinetuneConfig(
        task="gqa",
        features=[str(problem["features"])],
        train_files=[str(problem["gqa_train"])],
        valid_files=[str(problem["gqa_valid"])],
        init=str(problem["init"]),
    )
    summary = finetune(FinetuneRun(cfg, _train_cfg("gqa")), tmp_path / "gqa")
    assert summary["best"]["value"] > 100 / 3 + 25


@pytest.mark.slow
def test_nlvr2_learns(problem, tmp_path):
    cfg = FinetuneConfig(
        task="nlvr2",
        features=[str(problem["features"])],
        train_files=[str(problem["nlvr2_train"])],
        valid_files=[str(problem["nlvr2_valid"])],
        init=str(problem["init"]),
    )
    # 3e-3 (the QA tests' rate) can collapse the pair head onto one class, depending on float rounding
    summary = finetune(FinetuneRun(cfg, _train_cfg("nlvr2", lr=1e-3)), tmp_path / "nlvr2")
    cache = tmp_path / "nlvr2" / "cache"
    assert list(cache.glob("nlvr2-rows-sent-tokens-*")), "statements tokenised into cache/"
    assert len(list(cache.glob("nlvr2-rows-????????????????????????????????"))) == 2  # train and valid
    valid = summary["valid"]
    assert summary["best"]["value"] > 75, summary
    assert 0 <= valid["valid_consistency"] <= valid["valid_accuracy"]


def test_seeding_copies_exactly_the_shared_rows(problem):
    source = LxmertForPreTraining.from_pretrained(problem["init"])
    table = AnswerTable(["circle", "blue", "star", "red", "green"])  # blue and red are shared
    torch.manual_seed(1)
    model = LxmertForQuestionAnswering.from_pretrained(problem["init"], num_answers=len(table))
    with torch.no_grad():  # biases start at 0 on both sides: make every row tell where it came from
        model.answer_head.classifier.bias.copy_(-1.0 - torch.arange(len(table)))
    before = {k: v.clone() for k, v in model.answer_head.state_dict().items()}
    src = {k: v.clone() for k, v in source.qa_head.state_dict().items()}
    src["classifier.bias"] = 1.0 + torch.arange(len(PRETRAIN_ANSWERS), dtype=torch.float32)
    copied = seed_answer_head(model.answer_head, src, AnswerTable(PRETRAIN_ANSWERS), table)
    assert copied == 2
    after = model.answer_head.state_dict()
    for name in ("dense.weight", "dense.bias", "norm.weight", "norm.bias"):
        assert torch.equal(after[name], src[name])
    for mine, theirs in ((1, 2), (3, 0)):  # blue: 1 <- 2, red: 3 <- 0
        assert torch.equal(after["classifier.weight"][mine], src["classifier.weight"][theirs])
        assert torch.equal(after["classifier.bias"][mine], src["classifier.bias"][theirs])
    for unshared in (0, 2, 4):  # the release's load_lxmert_qa zeroes the rows of answers it cannot load
        assert not after["classifier.weight"][unshared].any()
        assert not before["classifier.weight"][unshared].eq(0).all()
    assert not torch.equal(before["classifier.weight"][1], after["classifier.weight"][1])
    assert after["classifier.bias"].tolist() == [0.0, 3.0, 0.0, 1.0, 0.0]


def test_task_seeds_the_head_from_the_init_directory(problem):
    cfg = FinetuneConfig(
        task="vqa",
        features=[str(problem["features"])],
        train_files=[str(problem["vqa_train"])],
        init=str(problem["init"]),
    )
    task = build_task(cfg)
    model = task.build_model()
    src = LxmertForPreTraining.from_pretrained(problem["init"]).qa_head.state_dict()
    for answer in ("red", "blue"):
        assert torch.equal(
            model.answer_head.classifier.weight[task.answers.index(answer)],
            src["classifier.weight"][PRETRAIN_ANSWERS.index(answer)],
        )
    unseeded = build_task(dataclasses.replace(cfg, seed_answer_head=False)).build_model()
    assert not torch.equal(unseeded.answer_head.dense.weight, src["dense.weight"])


def test_release_checkpoint_converted_with_its_answer_table_seeds_the_head(problem, tmp_path, caplog):
    """Epoch20_LXRT.pth + all_ans.json -> `xmodal convert lxmert --answers` -> `finetune --init` seeds."""
    from model import to_hf_state

    source = LxmertForPreTraining.from_pretrained(problem["init"])
    with torch.no_grad():
        source.qa_head.classifier.bias.copy_(1.0 + torch.arange(len(PRETRAIN_ANSWERS)))
    hf = to_hf_state(source.state_dict(), source.config, "LxmertForPreTraining")
    release = tmp_path / "Epoch20_LXRT.pth"
    torch.save({"module." + k.replace("lxmert.", "bert.", 1): v for k, v in hf.items()}, release)
    all_ans = tmp_path / "all_ans.json"
    all_ans.write_text(json.dumps([{"ans": a, "dsets": ["vqa", "gqa"]} for a in PRETRAIN_ANSWERS]))
    converted = tmp_path / "lxmert-release"
    assert main(["convert", "lxmert", str(release), str(converted), "--answers", str(all_ans)]) == 0
    cfg = FinetuneConfig(
        task="vqa",
        features=[str(problem["features"])],
        train_files=[str(problem["vqa_train"])],
        init=str(converted),
        vocab=str(problem["vocab"]),
    )
    task = build_task(cfg)
    model = task.build_model()
    src = source.qa_head.state_dict()
    for answer in ("red", "blue"):
        mine, theirs = task.answers.index(answer), PRETRAIN_ANSWERS.index(answer)
        assert torch.equal(model.answer_head.classifier.weight[mine], src["classifier.weight"][theirs])
        assert torch.equal(model.answer_head.classifier.bias[mine], src["classifier.bias"][theirs])
    # converted without its table: the head starts fresh, and the warning says how to fix that
    bare = tmp_path / "bare"
    assert main(["convert", "lxmert", str(release), str(bare)]) == 0
    with caplog.at_level(logging.WARNING, logger="pipelines.tasks.finetune"):
        unseeded = build_task(dataclasses.replace(cfg, init=str(bare))).build_model()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "no answer table" in r.message]
    assert warned and "--answers all_ans.json" in warned[0].message and "init_answers" in warned[0].message
    assert not torch.equal(unseeded.answer_head.dense.weight, src["dense.weight"])
    # ... and the table can be given at fine-tuning time instead
    seeded = build_task(dataclasses.replace(cfg, init=str(bare), init_answers=str(all_ans))).build_model()
    assert torch.equal(seeded.answer_head.dense.weight, src["dense.weight"])


def test_bad_inputs_name_the_problem(problem, tmp_path):
    base = FinetuneConfig(
        task="vqa",
        features=[str(problem["features"])],
        train_files=[str(problem["vqa_train"])],
        init=str(problem["init"]),
    )
    rows = json.loads(problem["vqa_train"].read_text())
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps(rows[:4] + [{**rows[0], "question_id": 10**6, "img_id": "nowhere"}]))
    with pytest.raises(
        ValueError,
        match=r"1 image ids are not in the feature store .*nowhere.*drop those examples with --skip-missing",
    ):
        build_task(dataclasses.replace(base, train_files=[str(missing)]))
    kept = build_task(dataclasses.replace(base, train_files=[str(missing)], skip_missing=True))
    assert len(kept.train_examples) == 4
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([rows[0], {"question_id": 5, "img_id": "img000"}]))
    with pytest.raises(ValueError, match=r"broken.json: row 2 \(line 1\): no 'question'"):
        build_task(dataclasses.replace(base, train_files=[str(broken)]))
    with pytest.raises(ValueError, match="visual_feat_dim=64"):
        build_task(
            dataclasses.replace(
                base, init=None, preset="tiny", vocab=str(problem["vocab"]), model={"visual_feat_dim": 64}
            )
        )
    code = main(
        [
            "finetune",
            "nlvr2",
            "--features",
            str(problem["features"]),
            "--train",
            str(problem["vqa_train"]),
            "--out",
            str(tmp_path / "x"),
            "--vocab",
            str(problem["vocab"]),
        ]
    )
    assert code == 1


def test_resume_continues_the_run(problem, tmp_path, capsys):
    out = tmp_path / "vqa"
    argv = _argv(problem, "vqa", out, "--batch-size", "16", "train.log_every=1", valid=False)
    assert main([*argv, "--max-steps", "2"]) == 0
    assert main([*argv, "--max-steps", "2"]) == 1  # the run exists: --resume or another --out
    assert main([*argv, "--max-steps", "4", "--resume"]) == 0
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4]
    capsys.readouterr()
    # a rerun with a new learning rate would continue the old run under it: refused, naming it
    assert main([*argv, "--max-steps", "6", "--resume", "--lr", "0.001"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("xmodal finetune: ") and "train.lr was 5e-05, now 0.001" in line
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    # asked for, the new rate goes on from the old run's checkpoint in a run directory of its own
    forked = tmp_path / "vqa-lr"
    fork_argv = [a if a != str(out) else str(forked) for a in argv]
    assert main([*fork_argv, "--max-steps", "6", "--fork", str(out), "--lr", "0.001"]) == 0
    assert [r["step"] for r in read_metrics(forked / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
    starts = [json.loads(line) for line in (forked / "history.jsonl").read_text().splitlines()]
    assert [(s["start"], s["step"]) for s in starts] == [("fork", 4), ("resume", 4)]
    assert starts[0]["from"] == str(out.resolve())
    assert starts[1]["changed"] == {"train.lr": [5e-05, 0.001], "train.max_steps": [4, 6]}
    assert "lr: 0.001" in (forked / "config.yaml").read_text()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4], (
        "untouched"
    )


@pytest.mark.slow
def test_two_ray_workers_fine_tune_and_write_best_and_last(problem, tmp_path, ray_two_cpus, monkeypatch):
    """Fine-tuning runs on the pre-training loop's Ray Train path: DDP over CPU workers, rank 0 writes;
    paths relative to the folder the command runs in work there too (Ray starts workers elsewhere)."""
    out = tmp_path / "nlvr2_ray"
    workers = ("--workers", "2", "--cpus-per-worker", "0.5")
    argv = _argv(
        problem, "nlvr2", out, "--max-steps", "2", "--batch-size", "8", *workers, "train.log_every=1"
    )
    monkeypatch.chdir(problem["root"])
    root = str(problem["root"]) + os.sep
    argv = [a.removeprefix(root) for a in argv]
    assert "feats.lmdb" in argv and "pretrain_last" in argv
    assert main(argv) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r and "valid_accuracy" not in r] == [1, 2]
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-2"]
    assert any("valid_consistency" in r for r in rows)
    for d in ("best", "last"):
        assert load_finetuned(out / d).task == "nlvr2"


def test_a_training_set_smaller_than_a_batch_trains_on_batches_of_its_size(caplog):
    """Issue 45: 27 photos' questions with the default batch of 32 train (a warning naming --batch-size)."""
    from pipelines.engine.trainer import TrainConfig
    from pipelines.tasks.finetuned import fitted_batch

    with caplog.at_level(logging.WARNING):
        assert fitted_batch(TrainConfig(batch_size=32), 27, "questions").batch_size == 27
    assert "27 questions, fewer than one batch (--batch-size 32): training on batches of 27" in caplog.text
    assert fitted_batch(TrainConfig(batch_size=32, grad_accum=2), 27).batch_size == 26  # divisible
    assert fitted_batch(TrainConfig(batch_size=8), 27).batch_size == 8
