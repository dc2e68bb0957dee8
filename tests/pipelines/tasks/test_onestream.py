"""VL-BERT and VisualBERT through the same tasks as LXMERT: pre-training objectives, fine-tuning, resume."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model import get_family
from pipelines.apps.ask import ask
from pipelines.cli import main as xmodal
from pipelines.data.masking import MaskingConfig
from pipelines.engine import config_io
from pipelines.engine.launch import fit
from pipelines.engine.run_log import read_metrics
from pipelines.tasks.finetuned import load_finetuned
from pipelines.tasks.pretrain import PretrainRun, PretrainTask, _masking_for
from storage import FeatureReader, FeatureWriter, RegionFeatures

from .synthetic_pretrain import COLOURS, FEATURE_DIM, SHAPES, make_pretrain_data

pytestmark = pytest.mark.usefixtures("one_thread")
ARCHES = ("vlbert", "visualbert")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_pretrain_data(tmp_path_factory.mktemp("onestream_data"))


def test_each_family_gets_the_objectives_its_heads_have():
    vl = _masking_for(get_family("vlbert").models["pretraining"], MaskingConfig())
    assert (vl.mlm, vl.whole_words, vl.regions) == (True, True, True)
    assert (vl.object_zero, vl.object_swap) == (0.0, 0.0)  # the model hides masked regions itself
    assert not (vl.matched or vl.qa or vl.obj or vl.attr or vl.feat)  # no mismatched captions, no matching
    vb = _masking_for(get_family("visualbert").models["pretraining"], MaskingConfig())
    assert (vb.mlm, vb.matched, vb.whole_words) == (True, True, False)
    assert not (vb.regions or vb.obj or vb.attr or vb.feat or vb.qa)


def _pretrain_args(data, out, arch: str, *extra: str) -> list[str]:
    return [
        "pretrain",
        "--arch",
        arch,
        "--features",
        str(data.features),
        "--train",
        str(data.train),
        "--vocab",
        str(data.vocab),
        "--out",
        str(out),
        "task.preset=tiny",
        "train.loader_workers=0",
        "train.log_every=1",
        "train.warmup_ratio=0.1",
        "train.batch_size=16",
        "train.lr=3e-3",
        *extra,
    ]


@pytest.mark.parametrize("arch", ARCHES)
def test_pretraining_losses_fall(data, tmp_path, arch, caplog):
    caplog.set_level(logging.INFO, logger="pipelines.tasks.pretrain")
    out = tmp_path / arch
    assert xmodal(_pretrain_args(data, out, arch, "--max-steps", "40")) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    expected = {"vlbert": {"mlm", "mvrc"}, "visualbert": {"mlm", "matched"}}[arch]
    assert expected <= set(rows[0])
    first = sum(r["loss"] for r in rows[:4]) / 4
    last = sum(r["loss"] for r in rows[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    if arch == "vlbert":  # the generated store has no class_probs: said once
        assert sum("no per-region class distribution" in r.getMessage() for r in caplog.records) == 1
    saved = json.loads((out / "last" / "config.json").read_text())
    assert saved["family"] == arch


class _Crash(Exception):
    pass


class _CrashingTask(PretrainTask):
    def __init__(self, *args, after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.after = 0, after

    def loss(self, model, batch):
        self.calls += 1
        if self.calls > self.after:
            raise _Crash
        return super().loss(model, batch)


@pytest.mark.parametrize("arch", ARCHES)
def test_pretraining_resumes_exactly(data, tmp_path, arch):
    overrides = ["task.preset=tiny", "train.loader_workers=0", "train.log_every=1"]
    run = config_io.load(PretrainRun, None, overrides)
    task = {
        "arch": arch,
        "features": [str(data.features)],
        "train_files": [str(data.train)],
        "vocab": str(data.vocab),
    }
    run = config_io.merge(run, {"task": task, "train": {"batch_size": 8, "lr": 1e-3, "max_steps": 4}})
    fit(PretrainTask(run.task), run.train, tmp_path / "straight")
    halves = tmp_path / "halves"
    with pytest.raises(_Crash):
        first = config_io.merge(run, {"train": {"save_every": 2}})
        fit(_CrashingTask(run.task, after=2), first.train, halves)
    fit(PretrainTask(run.task), run.train, halves, resume=True)
    a = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    b = load_file(halves / "last" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def _vqa_problem(root):
    """A store whose images hold 2-3 regions of one colour (features: shape + colour prototypes) and VQA
    files asking for it: the answer is in the regions only."""
    rng = np.random.default_rng(1)
    shape_protos = rng.uniform(0, 1, size=(len(SHAPES), FEATURE_DIM))
    colour_protos = rng.uniform(0, 1, size=(len(COLOURS), FEATURE_DIM))
    store = root / "vqa.lmdb"
    rows = []
    with FeatureWriter(store, feature_dim=FEATURE_DIM, max_boxes=3, dtype="float32") as writer:
        for i in range(120):
            n, colour = int(rng.integers(2, 4)), int(rng.integers(len(COLOURS)))
            shapes = rng.integers(len(SHAPES), size=n)
            feats = shape_protos[shapes] + colour_protos[colour] + 0.05 * rng.normal(size=(n, FEATURE_DIM))
            xy = rng.uniform(0, 80, size=(n, 2))
            writer.put(
                RegionFeatures(
                    img_id=f"q{i:03d}", img_h=120, img_w=160,
                    boxes=np.concatenate([xy, xy + 30], axis=1).astype(np.float32),
                    features=feats.astype(np.float32), objects_id=shapes.astype(np.int64),
                    objects_conf=np.ones(n, np.float32), attrs_id=np.full(n, colour, np.int64),
                    attrs_conf=np.ones(n, np.float32),
                )
            )  # fmt: skip
            rows.append({"question_id": i, "img_id": f"q{i:03d}", "sent": "what color is the circle?",
                         "label": {COLOURS[colour]: 1.0}})  # fmt: skip
    files = {"features": store, "colours": [COLOURS.index(next(iter(r["label"]))) for r in rows]}
    for split, chosen in (("train", rows[:96]), ("valid", rows[96:])):
        files[split] = root / f"vqa_{split}.json"
        files[split].write_text(json.dumps(chosen))
    return files


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_vqa_fine_tuning_learns_from_the_image(data, tmp_path, arch):
    files = _vqa_problem(tmp_path)
    out = tmp_path / arch
    features = str(files["features"])
    argv = [
        "finetune", "vqa", "--arch", arch, "--features", features, "--train", str(files["train"]),
        "--valid", str(files["valid"]), "--vocab", str(data.vocab), "--out", str(out), "--epochs", "25",
        "--batch-size", "16", "--lr", "3e-3", "task.preset=tiny", "task.model={visual_feat_dim: 32}",
        "train.loader_workers=0", "train.log_every=4", "train.optimizer=adamw",
    ]  # fmt: skip
    assert xmodal(argv) == 0
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["value"] > 20 + 25, best  # five colours: chance is 20 %
    preds = tmp_path / "preds.json"
    evaluate = ["evaluate", "vqa", "--checkpoint", str(out / "best"), "--features", features]
    assert xmodal([*evaluate, "--split", str(files["valid"]), "--out", str(preds)]) == 0
    scored = json.loads((tmp_path / "preds.metrics.json").read_text())["accuracy"]
    assert scored == pytest.approx(best["value"])  # the same scores as validation
    tuned = load_finetuned(out / "best")
    record = FeatureReader([features])["q100"]
    result = ask(tuned, record, "what color is the circle?")
    assert len(result.answers) >= 1 and result.attention.shape == (record.num_boxes,)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_nlvr2_and_gqa_run_through_the_same_commands(data, tmp_path, arch):
    files = _vqa_problem(tmp_path)
    rows = []
    for k in range(40):  # "there is a red circle": true when either image is red
        pair = [f"q{k:03d}", f"q{(k + 7) % 120:03d}"]
        label = int(any(files["colours"][int(i[1:])] == 0 for i in pair))
        rows.append(
            {
                "identifier": f"t-{k}-0-0",
                "img0": pair[0],
                "img1": pair[1],
                "sent": "there is a red circle",
                "label": label,
            }
        )
    nlvr2 = tmp_path / "nlvr2.jsonl"
    nlvr2.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [
        "--arch", arch, "--features", str(files["features"]), "--vocab", str(data.vocab), "--max-steps", "3",
        "--batch-size", "8", "task.preset=tiny", "task.model={visual_feat_dim: 32}", "train.loader_workers=0",
    ]  # fmt: skip
    for task, train in (("nlvr2", nlvr2), ("gqa", files["train"])):
        out = tmp_path / task
        assert (
            xmodal(
                ["finetune", task, "--train", str(train), "--valid", str(train), "--out", str(out), *common]
            )
            == 0
        )
        assert json.loads((out / "last" / "config.json").read_text())["family"] == arch
