"""Fine-tuning ViLBERT on the generated problems of test_finetune: the family comes from the init
directory, VQA and NLVR2 learn far above chance, `ask` shows the co-attention picture; retrieval learns
with ViLBERT's and LXMERT's matching heads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from model.vilbert import VilbertConfig, VilbertForPreTraining, VilbertForQuestionAnswering
from pipelines.tasks import get_finetune_task
from pipelines.tasks.finetune import FinetuneConfig, FinetuneRun
from pipelines.tasks.finetuned import finetune, load_finetuned

from .test_finetune import COLOURS, DIM, N_TRAIN, SHAPES, WORDS, _train_cfg, _write_store, problem  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vilbert_init(problem, tmp_path_factory):  # noqa: F811
    """A tiny ViLBERT "pre-training" directory with the problem's vocab."""
    init = tmp_path_factory.mktemp("vilbert") / "pretrain_last"
    torch.manual_seed(0)
    VilbertForPreTraining(
        VilbertConfig.preset("tiny", vocab_size=len(WORDS), visual_feat_dim=DIM)
    ).save_pretrained(init)
    (init / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    return init


def _config(problem, task: str, init, **kw) -> FinetuneConfig:  # noqa: F811
    return FinetuneConfig(
        task=task,
        features=[str(problem["features"])],
        train_files=[str(problem[f"{task}_train"])],
        valid_files=[str(problem[f"{task}_valid"])],
        init=str(init),
        **kw,
    )


def test_the_family_comes_from_the_init_directory(problem, vilbert_init):  # noqa: F811
    task = get_finetune_task("vqa")(_config(problem, "vqa", vilbert_init))
    assert task.family.name == "vilbert"
    assert isinstance(task.build_model(), VilbertForQuestionAnswering)
    with pytest.raises(ValueError, match="holds a vilbert model"):
        get_finetune_task("vqa")(_config(problem, "vqa", vilbert_init, arch="lxmert"))


@pytest.mark.slow
def test_vqa_learns_and_ask_shows_the_co_attention(problem, vilbert_init, tmp_path):  # noqa: F811
    from pipelines.apps.ask import ask
    from storage import FeatureReader

    summary = finetune(
        FinetuneRun(_config(problem, "vqa", vilbert_init), _train_cfg("vqa")), tmp_path / "vqa"
    )
    assert summary["best"]["value"] > 100 / 3 + 25, summary  # chance given the question: 33 %
    tuned = load_finetuned(tmp_path / "vqa" / "best")
    assert isinstance(tuned.model, VilbertForQuestionAnswering)
    assert json.loads((tmp_path / "vqa" / "best" / "finetune.json").read_text())["arch"] == "vilbert"
    store = FeatureReader([str(problem["features"])])
    rec = store[next(iter(store.keys()))]
    result = ask(tuned, rec, "what color is the object?")
    assert result.attention.shape == (rec.num_boxes,)
    assert (result.attention >= 0).all() and 0 < result.attention.sum() <= 1 + 1e-5


@pytest.mark.slow
def test_nlvr2_learns(problem, vilbert_init, tmp_path):  # noqa: F811
    run = FinetuneRun(_config(problem, "nlvr2", vilbert_init), _train_cfg("nlvr2", lr=1e-3))
    summary = finetune(run, tmp_path / "nlvr2")
    assert summary["best"]["value"] > 75, summary


def test_gqa_trains_a_step(problem, vilbert_init):  # noqa: F811
    task = get_finetune_task("gqa")(_config(problem, "gqa", vilbert_init))
    model = task.build_model()
    data = task.train_dataset()
    batch = task.collate([data[i] for i in range(4)], np.random.default_rng(0))
    loss, _ = task.loss(model, batch)
    assert torch.isfinite(loss)


@pytest.fixture(scope="module")
def retrieval(problem, tmp_path_factory):  # noqa: F811
    """Captions "a <colour> <shape>" of the problem's images (its store, rebuilt from the same seed for
    the truth): 128 training images, 32 to retrieve among."""
    root = tmp_path_factory.mktemp("retrieval")
    truth = _write_store(root / "copy.lmdb", np.random.default_rng(0))
    rows = [
        {"img_id": i, "sentences": [f"a {COLOURS[c]} {SHAPES[s]}"]} for i, (c, s) in sorted(truth.items())
    ]
    files = {}
    for split, chosen in (("train", rows[:N_TRAIN]), ("valid", rows[N_TRAIN:])):
        files[f"retrieval_{split}"] = root / f"{split}.json"
        files[f"retrieval_{split}"].write_text(json.dumps(chosen))
    return {**problem, **files}


@pytest.mark.slow
def test_retrieval_learns(retrieval, vilbert_init, tmp_path):
    # this tiny problem's rate and warm-up were tuned together: 4 warm-up updates (a fractional 4.8, the
    # release's rule for 10 % of 48, leaves R@5 below the bar)
    train = _train_cfg("retrieval", lr=1e-3, warmup_iters=4)
    run = FinetuneRun(_config(retrieval, "retrieval", vilbert_init), train)
    valid = finetune(run, tmp_path / "vilbert")["valid"]
    # 32 images, 9 colour-shape kinds: about 3.6 images fit a caption, so R@1 tops out near 28 %;
    # chance is 1/32 for R@1 and 5/32 for R@5
    assert valid["valid_R@5"] > 3 * 100 * 5 / 32, valid
    assert valid["valid_R@1"] <= valid["valid_R@5"] <= valid["valid_R@10"]


def test_lxmerts_matching_head_ranks_through_evaluate(retrieval, tmp_path):
    """The pre-training matching head loads and ranks every image for every caption. (It does not learn
    this problem at the tiny size within a test's budget: measured, the loss stays at ln 4 for 128 steps,
    as the pre-training matching loss stays at ln 2; ViLBERT's product fusion learns it above.)"""
    from pipelines.cli import main

    run = FinetuneRun(_config(retrieval, "retrieval", retrieval["init"]), _train_cfg("retrieval", epochs=1))
    finetune(run, tmp_path / "lxmert")
    out = tmp_path / "rankings.json"
    argv = ["evaluate", "retrieval", "--checkpoint", str(tmp_path / "lxmert" / "last")]
    argv += ["--features", str(retrieval["features"]), "--split", str(retrieval["retrieval_valid"])]
    assert main([*argv, "--out", str(out)]) == 0
    rankings = json.loads(out.read_text())
    assert len(rankings) == 32 and all(len(r["images"]) == 10 for r in rankings)
    metrics = json.loads((tmp_path / "rankings.metrics.json").read_text())
    assert 0 <= metrics["R@1"] <= metrics["R@5"] <= metrics["R@10"] <= 100
