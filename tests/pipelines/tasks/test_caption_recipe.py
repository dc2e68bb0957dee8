"""The captioning recipes: self-critical.pytorch's Up-Down settings one by one, its scheduled sampling,
batches of several references per image, and its SCST reward against a re-implementation written here."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from pipelines.engine import trainer
from pipelines.engine.checkpoints import STATE_FILE, latest_checkpoint, read_state
from pipelines.tasks.caption import RECIPES, CaptionTask, scheduled_sampling_prob
from pipelines.tasks.finetuned import default_run, finetune

from .caption_scenes import write_caption_corpus
from .test_caption import caption_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_caption_corpus(tmp_path_factory.mktemp("captions"))


def test_self_critical_updown_recipe_is_the_repository_s():
    run = default_run("caption", "self-critical-updown")
    task, train = run.task, run.train
    assert train.batch_size == 10 and task.captions_per_image == 5  # 10 images x 5 captions
    assert train.lr == 5e-4 and train.optimizer == "adamw" and train.weight_decay == 0.0
    assert train.clip_value == 0.1 and train.clip_norm is None  # grad_clip_mode=value, not the norm
    assert train.schedule == "epochs" and train.lr_decay_epochs == 3 and train.lr_gamma == 0.8
    assert train.warmup_ratio == 0.0 and train.warmup_iters is None and train.epochs == 30
    assert task.scheduled_sampling_start == 0 and task.scheduled_sampling_every == 5
    assert task.scheduled_sampling_increase == 0.05 and task.scheduled_sampling_max == 0.25
    assert task.model == {"normalize_features": False}
    assert task.max_length == 16 and task.arch == "updown"  # prepro_labels.py --max_length 16
    # prepro_labels.py: words seen more than 5 times over every split of dataset_coco.json
    assert task.vocab_min_count == 6 and task.vocab_from == "all"
    # train.py validates every save_checkpoint_every (3000) iterations, greedy (opts.py beam_size 1: no
    # <unk> penalty outside beam search) up to 20 words; its test decodes beam 5 with <unk> -1000
    assert train.eval_every == 3000 and task.beam_size == 1 and task.unk_penalty == 0.0
    assert task.decode_max_length == 20 and task.test_beam_size == 5 and task.test_unk_penalty == 1000.0
    assert task.init_optimizer is False
    scst = default_run("caption", "self-critical-updown-scst")
    assert scst.task.scst_from_epoch == 0 and scst.task.scst_samples == 5  # greedy baseline: the loss's
    assert scst.task.scst_reward == "self-critical" and scst.task.scst_suppress_unk is False
    assert scst.train.lr == 5e-5 and scst.train.clip_value == 0.1 and scst.train.batch_size == 10
    assert scst.task.scheduled_sampling_start is None
    # updown_sc.yml: --start_from the cross-entropy run (its Adam state too), epochs 30 -> 50
    assert scst.task.init_optimizer is True and scst.train.epochs == 20 and scst.train.lr_gamma == 1.0
    for name in ("vocab_min_count", "vocab_from", "beam_size", "unk_penalty", "decode_max_length",
                 "test_beam_size", "test_unk_penalty"):  # fmt: skip
        assert getattr(scst.task, name) == getattr(task, name), name
    assert scst.train.eval_every == 3000
    # the defaults stay xmodal's, under their own name
    assert default_run("caption", "xmodal") == default_run("caption")
    assert set(RECIPES) == {"xmodal", "self-critical-updown", "self-critical-updown-scst"}
    with pytest.raises(ValueError, match="recipe 'nope'"):
        default_run("caption", "nope")
    with pytest.raises(ValueError, match=r"--recipe applies to tasks with named recipes \(caption\)"):
        default_run("vqa", "self-critical-updown")


def test_recipe_is_a_choice_of_the_command_line(tmp_path, capsys):
    from pipelines.cli import main as xmodal

    with pytest.raises(SystemExit) as exit_info:
        xmodal(
            [
                "finetune",
                "caption",
                "--recipe",
                "self-critical",
                "--out",
                str(tmp_path / "run"),
                "--features",
                "f.lmdb",
                "--train",
                "t.json",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "invalid choice: 'self-critical'" in err
    assert all(name in err for name in RECIPES)  # the choices are the table's names
    rc = xmodal(
        [
            "finetune",
            "vqa",
            "--recipe",
            "self-critical-updown",
            "--out",
            str(tmp_path / "run"),
            "--features",
            "f.lmdb",
            "--train",
            "t.json",
        ]
    )
    assert rc == 1 and "--recipe applies" in capsys.readouterr().err


def _reference_lr(epoch: int) -> float:
    """train.py: epoch > decay_start (0) -> lr x rate ** ((epoch - start) // every)."""
    frac = epoch // 3 if epoch > 0 else 0
    return 5e-4 * 0.8**frac


def _reference_ss(epoch: int) -> float:
    frac = epoch // 5 if epoch > 0 else 0
    return min(0.05 * frac, 0.25)


def test_lr_decay_and_scheduled_sampling_follow_the_epochs():
    run = default_run("caption", "self-critical-updown")
    steps_per_epoch = 7
    factor = trainer._schedule(run.train, 30 * steps_per_epoch, steps_per_epoch)
    for epoch in range(30):
        for step in (epoch * steps_per_epoch, epoch * steps_per_epoch + 6):
            assert run.train.lr * factor(step) == pytest.approx(_reference_lr(epoch)), (epoch, step)
    for epoch in range(40):
        assert scheduled_sampling_prob(run.task, epoch) == pytest.approx(_reference_ss(epoch)), epoch
    assert scheduled_sampling_prob(default_run("caption").task, 20) == 0.0


def test_batches_hold_five_references_per_image_and_their_images(corpus):
    run = caption_run(corpus, captions_per_image=5)
    task = CaptionTask(run.task)
    items = [task.train_dataset()[i] for i in range(3)]
    batch = task.collate(items, np.random.default_rng(0))
    assert batch["visual_feats"].shape[0] == 3 and batch["input_ids"].shape[0] == 15
    assert batch["caption_rows"].tolist() == [0] * 5 + [1] * 5 + [2] * 5
    for row, image in enumerate(batch["caption_rows"].tolist()):
        ids = batch["labels"][row].tolist()
        caption = [i for i in ids if i not in (task.vocab.pad_id,)]
        assert caption in [c[1:].tolist() for c in items[image].captions[0]], row
    loss, parts = task.loss(task.build_model(), batch)
    assert torch.isfinite(loss) and parts == {}
    task.sampling_prob = 0.25
    model = task.build_model().train()
    torch.manual_seed(0)
    loss, parts = task.loss(model, batch)
    assert torch.isfinite(loss) and parts == {"ss_prob": 0.25}


def test_scheduled_sampling_feeds_the_model_s_own_words():
    from model.captioning import CaptionConfig, UpDownCaptioner

    cfg = CaptionConfig.preset("tiny", vocab_size=11, visual_feat_dim=6)
    model = UpDownCaptioner(cfg).train()
    feats = torch.randn(4, 3, 6)
    inputs = torch.randint(4, 11, (4, 5))
    inputs[:, 0] = cfg.bos_token_id
    torch.manual_seed(0)
    forced = model(inputs, visual_feats=feats, scheduled_sampling=0.0)
    torch.manual_seed(0)
    none = model(inputs, visual_feats=feats, scheduled_sampling=1e-9)  # the step loop, no word replaced
    torch.testing.assert_close(none.logits, forced.logits, atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    always = model(inputs, visual_feats=feats, scheduled_sampling=1.0)
    assert torch.allclose(always.logits[:, 0], forced.logits[:, 0], atol=1e-5)  # the first word is <bos>
    assert not torch.allclose(always.logits[:, 1:], forced.logits[:, 1:], atol=1e-3)
    model.eval()
    torch.testing.assert_close(
        model(inputs, visual_feats=feats, scheduled_sampling=1.0).logits,
        model(inputs, visual_feats=feats).logits,
    )  # evaluation is teacher-forced


# ---- self-critical.pytorch's SCST reward, re-implemented from pyciderevalcap's CiderD and rewards.py


def _array_to_str(arr: list[int], eos: int) -> str:
    out = []
    for token in arr:
        out.append(str(token))
        if token == eos:
            break
    return " ".join(out)


def _grams(words: list[str]) -> Counter:
    return Counter(tuple(words[i : i + k]) for k in range(1, 5) for i in range(len(words) - k + 1))


def _vec(counts: Counter, df: Counter, ref_len: float):
    vec = [dict() for _ in range(4)]
    norm = [0.0] * 4
    for gram, tf in counts.items():
        w = float(tf) * (ref_len - math.log(max(1.0, df[gram])))
        vec[len(gram) - 1][gram] = w
        norm[len(gram) - 1] += w * w
    return vec, [math.sqrt(x) for x in norm]


def _cider_d(candidate: str, refs: list[str], df: Counter, ref_len: float) -> float:
    cand_words = candidate.split()
    vc, nc = _vec(_grams(cand_words), df, ref_len)
    score = np.zeros(4)
    for ref in refs:
        ref_words = ref.split()
        vr, nr = _vec(_grams(ref_words), df, ref_len)
        delta = len(cand_words) - len(ref_words)
        for n in range(4):
            val = sum(min(vc[n][g], vr[n][g]) * vr[n][g] for g in vc[n] if g in vr[n])
            if nc[n] != 0 and nr[n] != 0:
                val /= nc[n] * nr[n]
            score[n] += val * math.exp(-(delta**2) / (2 * 6.0**2))
    return float(score.mean() / len(refs) * 10.0)


def test_self_critical_reward_equals_the_repository_s(corpus):
    run = caption_run(corpus, scst_reward="self-critical", max_length=6)
    task = CaptionTask(replace(run.task, vocab_min_count=75))  # left, of, and, ball, blue: <unk>
    vocab, eos, limit = task.vocab, task.vocab.eos_id, 6
    # prepro_ngrams.py: document frequencies over whole training captions + <eos>, rare words as UNK
    df: Counter = Counter()
    for e in task.train_examples:
        refs = [" ".join(str(vocab.index.get(w, vocab.unk_id)) for w in c) + f" {eos}" for c in e.label]
        df.update({g for r in refs for g in _grams(r.split())})
    ref_len = math.log(len(task.train_examples))
    # the label arrays: at most 6 ids, 0-padded (our <eos> after a caption that fits), read by array_to_str
    labels = {}
    for e in task.train_examples:
        rows = []
        for c in e.label:
            ids = [vocab.index.get(w, vocab.unk_id) for w in c][:limit]
            rows.append(_array_to_str(ids + [eos] * (limit - len(ids)), eos))
        labels[e.image_id] = rows
    assert any(len(c) >= limit for e in task.train_examples for c in e.label)  # truncation is exercised
    assert vocab.unk_id in {
        vocab.index.get(w, vocab.unk_id) for e in task.train_examples for c in e.label for w in c
    }
    g = torch.Generator().manual_seed(0)
    ids = [e.image_id for e in task.train_examples[:4]]
    tokens = torch.randint(4, len(vocab), (8, limit + 2), generator=g)
    tokens[0, 3] = eos
    tokens[0, 4:] = vocab.pad_id
    tokens[1] = torch.tensor(vocab.encode(task.train_examples[0].label[0], limit)[1:] + [vocab.pad_id])[
        : limit + 2
    ]
    rows = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    ours = task.reward(ids)(tokens, rows)
    expected = [
        _cider_d(_array_to_str(t, eos), labels[ids[r]], df, ref_len)
        for t, r in zip(tokens.tolist(), rows.tolist(), strict=True)
    ]
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-9, atol=1e-12)
    assert expected[1] > max(expected[2:])  # a reference itself scores highest


# ---- the four settings issue 44 made the repository's: vocabulary, validation and test decoding, SCST start


def _with_recipe(run, name: str):
    """`run` with the recipe's data and decoding settings (the model and schedule stay the tiny run's)."""
    task = default_run("caption", name).task
    keys = ("vocab_min_count", "vocab_from", "beam_size", "unk_penalty", "decode_max_length",
            "test_beam_size", "test_unk_penalty")  # fmt: skip
    run.task = replace(run.task, **{k: getattr(task, k) for k in keys})
    return run


def test_the_vocabulary_counts_every_split_more_than_five_times(corpus, tmp_path):
    """prepro_labels.py's build_vocab: counts over every image of dataset_coco.json, `n > count_thr`."""
    store, split_file = corpus
    data = json.loads(split_file.read_text())
    for k, row in enumerate(data["images"]):  # 'zebra' 6 times in val only, 'kite' 5 times in train
        if row["split"] == "val" and sum(r["split"] == "val" for r in data["images"][: k + 1]) <= 6:
            row["sentences"][0]["tokens"].append("zebra")
        if row["split"] == "train" and sum(r["split"] == "train" for r in data["images"][: k + 1]) <= 5:
            row["sentences"][0]["tokens"].append("kite")
    edited = tmp_path / "dataset_coco.json"
    edited.write_text(json.dumps(data))
    counts = Counter(w for row in data["images"] for s in row["sentences"] for w in s["tokens"])
    run = _with_recipe(caption_run((store, edited)), "self-critical-updown")
    words = set(CaptionTask(run.task).vocab.words[4:])
    assert words == {w for w, n in counts.items() if n > 5}
    assert "zebra" in words and "kite" not in words
    xmodal = set(CaptionTask(replace(run.task, vocab_min_count=5, vocab_from="train")).vocab.words[4:])
    assert "kite" in xmodal and "zebra" not in xmodal  # xmodal's own: at least 5, training splits


def test_validation_is_greedy_to_20_words_and_evaluate_beam_5(corpus, tmp_path, monkeypatch):
    import pipelines.tasks.caption as caption
    from pipelines.apps.evaluate import evaluate

    monkeypatch.setattr("pipelines.scoring.captions.java_available", lambda: False)
    seen = []

    def spy(model, features, mask, beam_size, **options):
        seen.append((beam_size, options["max_length"], options["unk_penalty"]))
        return real(model, features, mask, beam_size, **options)

    real = caption.beam_search
    monkeypatch.setattr(caption, "beam_search", spy)
    store, split_file = corpus
    finetune(_with_recipe(caption_run(corpus, steps=2), "self-critical-updown"), tmp_path / "run")
    assert seen and set(seen) == {(1, 20, 0.0)}  # the run's validation
    seen.clear()
    evaluate(tmp_path / "run" / "last", [store], [f"{split_file}:val"], tmp_path / "test.json")
    assert set(seen) == {(5, 20, 1000.0)}
    seen.clear()
    evaluate(tmp_path / "run" / "last", [store], [f"{split_file}:val"], tmp_path / "b2.json", beam_size=2)
    assert set(seen) == {(2, 20, 1000.0)}


def test_the_scst_recipe_continues_the_cross_entropy_run_s_adam_state(corpus, tmp_path):
    """updown_sc.yml's --start_from: the weights and optimizer.pth of the cross-entropy run; the new rate."""
    finetune(caption_run(corpus, steps=3), tmp_path / "xe")
    saved = read_state(latest_checkpoint(tmp_path / "xe" / "checkpoints") / STATE_FILE)["optimizer"]["state"]
    init = str(tmp_path / "xe" / "last")
    run = caption_run(corpus, steps=2, scst_from_epoch=0, init=init, init_optimizer=True)
    run.train.lr = 5e-5
    started = trainer.TrainingRun(CaptionTask(run.task), run.train, tmp_path / "scst", resume=False)
    started._build()
    started._restore()
    state = started.optimizer.state_dict()["state"]
    assert saved and state.keys() == saved.keys()
    for k in saved:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[k][name], saved[k][name]), (k, name)
    assert all(group["lr"] == 5e-5 for group in started.optimizer.param_groups)
    fresh = trainer.TrainingRun(
        CaptionTask(replace(run.task, init_optimizer=False)), run.train, tmp_path / "fresh", resume=False
    )
    fresh._build()
    fresh._restore()
    assert fresh.optimizer.state_dict()["state"] == {}
    summary = finetune(run, tmp_path / "scst")  # and the SCST steps run on from there
    assert summary["step"] == 3 + 2  # counting on from the cross-entropy run's step, as --start_from
    shutil.copytree(tmp_path / "xe" / "last", tmp_path / "lone")  # weights without their run
    lone = replace(run.task, init=str(tmp_path / "lone"))
    with pytest.raises(ValueError, match="has no optimizer state to continue") as exc:
        CaptionTask(lone).init_trainer_states()
    assert len(str(exc.value).splitlines()) == 1
    # the run's own directory, as --start_from takes it, stands for its last/ (weights and optimizer)
    whole = replace(run.task, init=str(tmp_path / "xe"))
    assert whole.init == init
    assert CaptionTask(whole).init_trainer_states() == CaptionTask(run.task).init_trainer_states()


def test_scst_samples_and_its_baseline_run_to_the_decoding_length(corpus, tmp_path, monkeypatch):
    """AttModel._sample draws SCST's captions and the greedy baseline up to opts.py's max_length (20
    words), past the 16-word training captions; the recipe decodes validation to 20 as well."""
    import model.captioning.self_critical as self_critical

    lengths = []

    def spy(real):
        def decode(model, features, mask=None, max_length=None, *args, **kwargs):
            lengths.append((real.__name__, max_length or model.config.max_length))
            return real(model, features, mask, max_length, *args, **kwargs)

        return decode

    monkeypatch.setattr(self_critical, "greedy", spy(self_critical.greedy))
    monkeypatch.setattr(self_critical, "sample", spy(self_critical.sample))
    run = _with_recipe(
        caption_run(corpus, steps=1, scst_from_epoch=0, max_length=16), "self-critical-updown-scst"
    )
    run.train.eval_every = None
    finetune(run, tmp_path / "scst")
    assert set(lengths) == {("greedy", 20), ("sample", 20)}


def test_scst_after_cross_entropy_counts_on_and_must_beat_its_best(corpus, tmp_path):
    """train.py with --start_from: `iteration = infos['iter']` (validation every save_checkpoint_every of
    the whole count) and `best_val_score = infos['best_val_score']` (load_best_score 1): the SCST model is
    the best only when its CIDEr beats the cross-entropy run's best."""
    finetune(caption_run(corpus, steps=3), tmp_path / "xe")
    xe_best = json.loads((tmp_path / "xe" / "best" / "best.json").read_text())
    run = caption_run(
        corpus, steps=2, scst_from_epoch=0, init=str(tmp_path / "xe" / "last"), init_optimizer=True
    )
    run.train.eval_every = 4  # due at step 4 of the whole count: the SCST run's first step
    started = trainer.TrainingRun(CaptionTask(run.task), run.train, tmp_path / "scst", resume=False)
    started._build()
    started._restore()
    assert started.step == 3 and started.total_steps == 5
    assert started.best["value"] == xe_best["value"] and started.best["step"] == xe_best["step"]
    summary = finetune(run, tmp_path / "scst")
    assert summary["step"] == 5
    assert latest_checkpoint(tmp_path / "scst" / "checkpoints").name.endswith("5")
    rows = [json.loads(line) for line in (tmp_path / "scst" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in rows if "valid_CIDEr" in r]
    assert [r["step"] for r in valid] == [4, 5]
    best = summary["best"]
    beaten = [r for r in valid if r["valid_CIDEr"] > xe_best["value"]]
    if beaten:
        assert best["step"] >= 4 and (tmp_path / "scst" / "best").is_dir()
    else:
        assert best["value"] == xe_best["value"] and not (tmp_path / "scst" / "best").exists()
