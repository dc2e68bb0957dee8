"""The TASKS table: every task builds its model on a tiny store and trains one step; the CLI offers exactly
the table's fine-tuning tasks; the names compared nowhere else (tests/pipelines/test_layers.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.cli import build_parser
from pipelines.tasks import TASKS, finetuning_tasks, get_finetune_task
from pipelines.tasks.finetune import FinetuneConfig, FinetuneTask
from pipelines.tasks.pretrain import PretrainConfig, PretrainTask
from storage import FeatureWriter, RegionFeatures

DIM = 16
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "color", "is", "it", "?", "red", "blue", "a"]
IMAGES = [f"img{i}" for i in range(8)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("table")
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "f.lmdb", feature_dim=DIM, max_boxes=4, dtype="float32") as w:
        for img in IMAGES:
            n = int(rng.integers(2, 5))
            xy = rng.uniform(0, 50, (n, 2))
            boxes = np.concatenate([xy, xy + 10], axis=1).astype(np.float32)
            ones = np.ones(n, np.float32)
            feats = rng.random((n, DIM), dtype=np.float32)
            w.put(
                RegionFeatures(
                    img, 80, 60, boxes, feats, np.zeros(n, np.int64), ones, np.zeros(n, np.int64), ones
                )
            )
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    answers = ("red", "blue")
    qa = [
        {"question_id": i, "img_id": img, "sent": "what color is it?", "label": {answers[i % 2]: 1.0}}
        for i, img in enumerate(IMAGES)
    ]
    nlvr2 = [
        {"identifier": f"dev-{i}-0-0", "img0": img, "img1": IMAGES[-1 - i], "sent": "a red", "label": i % 2}
        for i, img in enumerate(IMAGES)
    ]
    pretrain = [
        {"img_id": img, "sentf": {"vqa": ["what color is it?"]}, "labelf": {"vqa": [{answers[i % 2]: 1.0}]}}
        for i, img in enumerate(IMAGES)
    ]
    retrieval = [{"img_id": img, "sentences": ["a red", "a blue"]} for img in IMAGES]
    tasks = (("vqa", qa), ("gqa", qa), ("nlvr2", nlvr2), ("pretrain", pretrain), ("retrieval", retrieval))
    for name, rows in tasks:
        (root / f"{name}.json").write_text(json.dumps(rows))
    karpathy = [
        {"filename": f"{img}.jpg", "split": "train", "cocoid": i,
         "sentences": [{"tokens": ["a", answers[i % 2], "thing"], "raw": f"A {answers[i % 2]} thing."}]}
        for i, img in enumerate(IMAGES)
    ]  # fmt: skip
    (root / "caption.json").write_text(json.dumps({"images": karpathy, "dataset": "coco"}))
    return root


# what a task needs beyond the shared settings: the captioner builds its own word vocabulary
SPECIFIC = {"caption": {"vocab": None, "arch": "updown", "vocab_min_count": 1}}


def _task(name: str, root):
    common = {
        "features": [str(root / "f.lmdb")],
        "train_files": [str(root / f"{name}.json")],
        "vocab": str(root / "vocab.txt"),
        "preset": "tiny",
        "model": {"visual_feat_dim": DIM},
    }
    cls = TASKS[name]
    if issubclass(cls, FinetuneTask):
        return cls(FinetuneConfig(task=name, **{**common, **SPECIFIC.get(name, {})}))
    assert cls is PretrainTask
    return cls(PretrainConfig(**common))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_builds_and_takes_a_training_step(name, files):
    task = _task(name, files)
    assert TASKS[name].name == name
    model = task.build_model()
    data = task.train_dataset()
    batch = task.collate([data[i] for i in range(4)], np.random.default_rng(0))
    loss, _ = task.loss(model, batch)
    assert torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def _choices(command: str) -> set[str]:
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")
    task_arg = next(a for a in sub.choices[command]._actions if a.dest == "task")
    return set(task_arg.choices)


def test_the_cli_offers_exactly_the_tables_fine_tuning_tasks():
    assert set(finetuning_tasks()) == {n for n, c in TASKS.items() if issubclass(c, FinetuneTask)}
    assert set(finetuning_tasks()) >= {"vqa", "gqa", "nlvr2"}
    assert _choices("finetune") == _choices("evaluate") == set(finetuning_tasks())


def test_a_config_for_another_task_or_an_unknown_task_is_refused(files):
    with pytest.raises(ValueError, match="unknown task 'okvqa'"):
        get_finetune_task("okvqa")
    with pytest.raises(ValueError, match="unknown task 'pretrain'"):  # not a fine-tuning task
        get_finetune_task("pretrain")
    with pytest.raises(ValueError, match="a vqa config given to the gqa task"):
        TASKS["gqa"](FinetuneConfig(task="vqa", features=[str(files / "f.lmdb")], train_files=["x"]))
    with pytest.raises(ValueError, match="unknown model family 'vilbert9'"):
        TASKS["vqa"](
            FinetuneConfig(task="vqa", arch="vilbert9", features=[str(files / "f.lmdb")], train_files=["x"])
        )
