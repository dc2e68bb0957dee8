"""The caption task through the engine: cross-entropy learns, SCST switches on, resume is exact; commands."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipelines.apps.caption import caption_regions
from pipelines.cli import main
from pipelines.data.captions import VOCAB_FILE, Vocabulary
from pipelines.data.image_refs import StoreImages
from pipelines.engine.checkpoints import STATE_FILE
from pipelines.engine.run_log import read_metrics
from pipelines.engine.trainer import TrainConfig
from pipelines.scoring.cider import CiderD
from pipelines.tasks.caption import CaptionTask, references
from pipelines.tasks.finetune import FinetuneConfig, FinetuneRun
from pipelines.tasks.finetuned import finetune, load_finetuned
from storage import FeatureReader

from .caption_scenes import DIM, write_caption_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_caption_corpus(tmp_path_factory.mktemp("captions"))


def caption_run(corpus, arch: str = "updown", steps: int = 40, **task) -> FinetuneRun:
    store, split_file = corpus
    return FinetuneRun(
        task=FinetuneConfig(
            task="caption",
            arch=arch,
            features=[str(store)],
            train_files=[f"{split_file}:train"],
            valid_files=[f"{split_file}:val"],
            preset="tiny",
            model={"visual_feat_dim": DIM},
            vocab_min_count=1,
            **task,
        ),
        train=TrainConfig(
            lr=1e-2,
            batch_size=20,
            max_steps=steps,
            warmup_ratio=0.0,
            weight_decay=0.0,
            clip_norm=1.0,
            loader_workers=0,
            log_every=1,
            eval_every=steps,
            seed=0,
        ),  # fmt: skip
    )


def test_task_reads_karpathy_splits_and_builds_the_vocabulary(corpus):
    task = CaptionTask(caption_run(corpus).task)
    assert len(task.train_examples) == 60 and len(task.valid_examples) == 12  # restval counts as train
    assert task.vocab.words[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert {"left", "of", "red", "cube"} <= set(task.vocab.words)
    assert task.model_config.vocab_size == len(task.vocab)
    batch = task.collate(
        [task.train_dataset()[i] for i in range(3)], __import__("numpy").random.default_rng(0)
    )
    assert batch["input_ids"][:, 0].eq(task.vocab.bos_id).all()
    assert batch["visual_feats"].shape[0] == 3 and batch["visual_attention_mask"].dtype == torch.int64


def test_cross_entropy_learns_the_captions(corpus, tmp_path):
    summary = finetune(caption_run(corpus, steps=60), tmp_path / "run")
    task = CaptionTask(caption_run(corpus).task)
    constant = CiderD(references(task.valid_examples)).corpus_score(
        {e.image_id: "a red cube left of a red cube" for e in task.valid_examples}
    )[0]
    assert summary["best"]["metric"] == "CIDEr"
    assert summary["best"]["value"] > 100 * constant + 150, (summary["best"], constant)
    assert (tmp_path / "run" / "best" / VOCAB_FILE).is_file()


def test_self_critical_phase_logs_rewards(corpus, tmp_path):
    """Epochs before `scst_from_epoch` train with cross-entropy, the later ones with SCST rewards."""
    finetune(caption_run(corpus, steps=9, scst_from_epoch=2), tmp_path / "run")  # 3 steps per epoch
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [("reward" in r) for r in rows] == [False] * 6 + [True] * 3
    assert all(0 <= r["reward"] <= 10 for r in rows[6:])
    # The captioning page's two-run recipe: SCST from the start of a run initialised from the
    # cross-entropy one.
    run = caption_run(corpus, steps=3, scst_from_epoch=0, init=str(tmp_path / "run" / "last"))
    finetune(run, tmp_path / "scst")
    rows = [r for r in read_metrics(tmp_path / "scst" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3 and all("reward" in r and "greedy_reward" in r for r in rows)
    assert (
        Vocabulary.load(tmp_path / "scst" / "last" / VOCAB_FILE).words
        == Vocabulary.load(tmp_path / "run" / "last" / VOCAB_FILE).words
    )


@pytest.mark.parametrize("arch", ["sat-hard", "updown"])
def test_resume_is_exact(corpus, tmp_path, arch):
    """A run resumed from its step-2 checkpoint ends with the uninterrupted run's weights, replaying a
    cross-entropy step (hard attention's sampled regions and baseline) and the SCST steps (sampled
    captions)."""
    run = caption_run(corpus, arch=arch, steps=6, scst_from_epoch=1)
    run.train.save_every = 2  # checkpoints at steps 2, 4, 6; epochs of 3 steps, SCST from step 4
    finetune(run, tmp_path / "whole")
    partial = tmp_path / "partial"
    shutil.copytree(tmp_path / "whole", partial)
    for name in ("last", "best", "checkpoints/step-4", "checkpoints/step-6"):
        shutil.rmtree(partial / name, ignore_errors=True)
    assert (partial / "checkpoints").is_dir()
    finetune(run, partial, resume=True)
    whole = torch.load(tmp_path / "whole" / "checkpoints" / "step-6" / STATE_FILE, weights_only=True)["model"]
    again = torch.load(partial / "checkpoints" / "step-6" / STATE_FILE, weights_only=True)["model"]
    assert list(whole) == list(again)
    for key in whole:
        assert torch.equal(whole[key], again[key]), key


def test_finetune_and_evaluate_through_the_cli(corpus, tmp_path, capsys, monkeypatch):
    # METEOR's Java start takes ~10 s here; tests/pipelines/scoring covers it, this test the command.
    monkeypatch.setattr("pipelines.scoring.captions.java_available", lambda: False)
    store, split_file = corpus
    out = tmp_path / "run"
    argv = ["finetune", "caption", "--arch", "sat-soft", "--features", str(store),
            "--train", f"{split_file}:train", "--valid", f"{split_file}:val", "--out", str(out),
            "task.preset=tiny", "--max-steps", "3", "--batch-size", "20", f"task.model.visual_feat_dim={DIM}",
            "task.vocab_min_count=1", "train.loader_workers=0"]  # fmt: skip
    assert main(argv) == 0
    results = tmp_path / "captions_val.json"
    assert main(["evaluate", "caption", "--checkpoint", str(out / "last"), "--features", str(store),
                 "--split", f"{split_file}:val", "--out", str(results)]) == 0  # fmt: skip
    rows = json.loads(results.read_text())
    assert (
        len(rows) == 12 and set(rows[0]) == {"image_id", "caption"} and isinstance(rows[0]["image_id"], int)
    )
    printed = capsys.readouterr().out
    assert "CIDEr" in printed and "Bleu_4" in printed
    vocab = Vocabulary.load(out / "last" / VOCAB_FILE)
    assert all(w in vocab.index for row in rows for w in row["caption"].split())

    # the beam width: the run's by default (what validation used), --beam-size otherwise, each caption the
    # one `caption_regions` decodes from the image's stored regions with that width
    tuned = load_finetuned(out / "last")
    reader = StoreImages(FeatureReader(store))  # rows name files; the store keys stems: the one rule
    ids = {int(e.image_id): e.img_id for e in CaptionTask.load_examples([f"{split_file}:val"])}

    def decoded(beam_size: int) -> dict[int, str]:
        return {i: caption_regions(tuned, reader[ids[i]], beam_size).caption for i in ids}

    assert tuned.settings["beam_size"] == 3 and {r["image_id"]: r["caption"] for r in rows} == decoded(3)
    assert main(["evaluate", "caption", "--checkpoint", str(out / "last"), "--features", str(store),
                 "--split", f"{split_file}:val", "--out", str(results), "--beam-size", "1"]) == 0  # fmt: skip
    assert {r["image_id"]: r["caption"] for r in json.loads(results.read_text())} == decoded(1)


def test_arch_must_be_a_captioner(corpus):
    with pytest.raises(ValueError, match="not a captioner"):
        CaptionTask(FinetuneConfig(**{**caption_run(corpus).task.__dict__, "arch": "lxmert"}))


def test_an_init_that_is_not_a_captioning_run_is_named(corpus, tmp_path):
    (tmp_path / "vqa_best").mkdir()
    cases = ((tmp_path / "nowhere", "does not exist"), (tmp_path / "vqa_best", "has no vocab.json"))
    for init, what in cases:
        with pytest.raises(ValueError, match=f"--init {init} {what}: it is not a captioning run's directory"):
            CaptionTask(FinetuneConfig(**{**caption_run(corpus).task.__dict__, "init": str(init)}))


def test_show_attend_tell_trains_on_a_grid_store_and_draws_its_attention_over_the_cells(corpus, tmp_path):
    """A 14x14 grid store from the small detector: soft attention trains on its 196 cells, and captioning
    a new image rebuilds the grid extractor from the store's provenance and lights cells, one per word."""
    import dataclasses
    import warnings

    import cv2
    import numpy as np

    from extraction import Detector
    from extraction.config import SMALL_PRESET
    from pipelines.apps.caption import caption_image
    from storage import FeatureWriter

    _, split_file = corpus
    ids = [row["filename"][:-4] for row in json.loads(split_file.read_text())["images"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        det = Detector.build(SMALL_PRESET, grid="14x14")
    rng = np.random.default_rng(0)
    images = [cv2.resize(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8), (160, 120)) for _ in ids]
    store = tmp_path / "grid.lmdb"
    with FeatureWriter(store, feature_dim=det.feature_dim, max_boxes=196, meta=det.provenance()) as writer:
        for record in det.detect(images, ids):
            writer.put(record)

    run = caption_run((store, split_file), arch="sat-soft", steps=4)
    run.task = dataclasses.replace(run.task, model={"visual_feat_dim": det.feature_dim})
    finetune(run, tmp_path / "run")
    image = tmp_path / "new.png"
    cv2.imwrite(str(image), images[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = caption_image(
            image, tmp_path / "run" / "last", explain=tmp_path / "attention.png", beam_size=2
        )
    assert result.regions.num_boxes == 196
    np.testing.assert_array_equal(result.regions.features, det.detect([images[0]], ["new"])[0].features)
    assert result.attentions.shape == (len(result.words), 196)
    picture = cv2.imread(str(tmp_path / "attention.png"))
    assert picture is not None and picture.shape[0] > 224


def test_vocab_means_a_word_list_for_a_captioner_too(corpus, tmp_path):
    """Issue 45: `--vocab vocab.txt` (as `xmodal vocab build` writes) works; a hub id is one refusal."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n##ed\nred\ngreen\nblue\ncube\nball\ncone\n")
    task = CaptionTask(FinetuneConfig(**{**caption_run(corpus).task.__dict__, "vocab": str(vocab)}))
    assert task.vocab.words[4:] == ["red", "green", "blue", "cube", "ball", "cone"]
    with pytest.raises(
        ValueError, match=r"^--vocab bert-base-uncased: no such file; a captioner takes a word"
    ):
        CaptionTask(FinetuneConfig(**{**caption_run(corpus).task.__dict__, "vocab": "bert-base-uncased"}))
    table = tmp_path / "questions.csv"
    table.write_text("image,question,answer\n")
    with pytest.raises(ValueError, match=r"^--vocab: caption JSON .*questions.csv.*: not valid JSON"):
        CaptionTask(FinetuneConfig(**{**caption_run(corpus).task.__dict__, "vocab": str(table)}))


def test_a_tiny_caption_vocabulary_is_a_warning(corpus, caplog):
    with caplog.at_level("WARNING"):
        CaptionTask(FinetuneConfig(**{**caption_run(corpus).task.__dict__, "vocab_min_count": 1000}))
    (warning,) = [r.getMessage() for r in caplog.records if "caption vocabulary" in r.getMessage()]
    assert "has only 0 words" in warning and "pass --vocab vocab.txt" in warning


def test_a_karpathy_file_validates_on_its_own_val_split(corpus, tmp_path, capsys):
    """Issue 45: `--train dataset_coco.json` alone validates on the file's `val` images (LAVIS,
    self-critical.pytorch), so the run keeps a best/; a run without validation says why it has none."""
    store, split_file = corpus
    cfg = {**caption_run(corpus).task.__dict__, "train_files": [str(split_file)], "valid_files": []}
    task = CaptionTask(FinetuneConfig(**cfg))
    assert len(task.train_examples) == 60 and len(task.valid_examples) == 12

    run = caption_run(corpus, steps=1)
    run.task.valid_files = []
    finetune(run, tmp_path / "cap")
    assert not (tmp_path / "cap" / "best").exists()
    argv = ["evaluate", "caption", "--checkpoint", str(tmp_path / "cap" / "best"), "--features", str(store)]
    assert main([*argv, "--split", f"{split_file}:val", "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err
    assert "the run had no validation set" in err and str(tmp_path / "cap" / "last") in err


def test_coco_captions_validate_on_the_val_file_beside_them(tmp_path):
    from pipelines.tasks.caption import own_validation

    doc = {"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"image_id": 1, "caption": "a cat"}]}
    for name in ("captions_train2014.json", "captions_val2014.json"):
        (tmp_path / name).write_text(json.dumps(doc))
    rows = tmp_path / "captions.json"
    rows.write_text(json.dumps([{"image": "a.jpg", "caption": "a cat"}]))
    train = str(tmp_path / "captions_train2014.json")
    assert own_validation([train]) == [str(tmp_path / "captions_val2014.json")]
    assert own_validation([f"{train}:train", str(rows)]) == []  # a split chosen, or rows without splits
