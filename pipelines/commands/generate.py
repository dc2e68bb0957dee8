"""`xmodal generate`: DALL-E's stages: `train-tokenizer` (the dVAE), `tokenize` (token grids into a store)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pipelines.commands.run_options import add_overrides_argument

log = logging.getLogger(__name__)

TOKENIZER_EPILOG = """\
precedence: preset defaults < --config YAML (train.* and task.* keys; a run's config.yaml works) < flags
< KEY=VALUE overrides (e.g. train.lr=1e-3 task.dvae.codebook_size=1024 task.dvae.kl_weight=0.5).
The run directory holds best/ (by held-out round-trip PSNR), last/, checkpoints/, metrics.jsonl and
config.yaml; best/ and last/ load with model.dalle.DiscreteVAE.from_pretrained.
"""

TRAIN_EPILOG = """\
precedence: preset defaults < --config YAML (train.* and task.* keys; a run's config.yaml works) < flags
< KEY=VALUE overrides (e.g. train.lr=5e-4 task.dalle.attention=sparse). Every checkpoint (best/ by held-out
image-token log-likelihood, last/) holds the transformer, caption_vocab.json and the dVAE in dvae/, so
`xmodal generate sample --checkpoint RUN` needs nothing else.
"""


def add_rerank_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    from pipelines.apps.generate.rerank import RERANKERS

    parser.add_argument(
        "--rerank",
        choices=RERANKERS,
        default=default,
        help="candidate order: the transformer's log p(image | prompt) (likelihood), that minus its mean "
        "over other prompts (contrastive), a fine-tuned captioner's log p(prompt | the candidate's detected "
        "regions) (captioner, needs --captioner), a retrieval-tuned LXMERT/ViLBERT's matching score of "
        "(prompt, regions) (matching, needs --matcher), or none (the sampling order)",
    )
    parser.add_argument(
        "--captioner",
        metavar="RUN",
        help="with --rerank captioner: a `xmodal finetune --task caption` run's best/",
    )
    parser.add_argument(
        "--captioner-detector",
        metavar="DIR",
        help="the detector directory the captioner's features came from (default: the one they record)",
    )
    parser.add_argument(
        "--matcher",
        metavar="RUN",
        help="with --rerank matching: a `xmodal finetune --task retrieval` run's best/",
    )
    parser.add_argument(
        "--matcher-detector",
        metavar="DIR",
        help="the detector directory the matcher's features came from (default: the one they record)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from model.dalle import DalleConfig, DVAEConfig

    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    tok = sub.add_parser(
        "train-tokenizer",
        help="train the discrete VAE image tokenizer",
        description="train DALL-E's discrete VAE on an image folder (Gumbel-softmax, annealed temperature "
        "and KL weight)",
        epilog=TOKENIZER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tok.add_argument("--images", help="image folder or list file")
    tok.add_argument("--out", required=True, help="run directory")
    tok.add_argument("--preset", choices=sorted(DVAEConfig.PRESETS), help="dVAE shapes (default: small)")
    tok.add_argument("--config", help="YAML with train.* and task.* keys (a run's config.yaml works)")
    tok.add_argument("--max-steps", type=int, help="optimizer steps")
    tok.add_argument("--batch-size", type=int, help="images per step")
    tok.add_argument("--lr", type=float, help="peak learning rate")
    tok.add_argument("--seed", type=int, help="seed of shuffling, relaxation noise and initialisation")
    tok.add_argument("--resume", action="store_true", help="continue the run in --out")
    add_overrides_argument(tok, "config overrides, e.g. task.dvae.codebook_size=1024")

    tr = sub.add_parser(
        "train",
        help="train the text-and-image transformer from a token store and a captions file",
        description="train DALL-E's transformer on (caption, token grid) pairs: captions from a Karpathy "
        "split file, grids from `xmodal generate tokenize`",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tr.add_argument("--features", help="image-token store from `xmodal generate tokenize`")
    tr.add_argument("--captions", help="captions as a Karpathy split file (dataset_coco.json layout)")
    tr.add_argument("--tokenizer", help="the train-tokenizer run (or dVAE directory) that made the store")
    tr.add_argument("--out", required=True, help="run directory")
    tr.add_argument(
        "--preset", choices=sorted(DalleConfig.PRESETS), help="transformer shapes (default: small)"
    )
    tr.add_argument("--config", help="YAML with train.* and task.* keys (a run's config.yaml works)")
    tr.add_argument("--max-steps", type=int, help="optimizer steps")
    tr.add_argument("--batch-size", type=int, help="caption-image pairs per step")
    tr.add_argument("--lr", type=float, help="peak learning rate")
    tr.add_argument("--seed", type=int, help="seed of shuffling and initialisation")
    tr.add_argument(
        "--caption-dropout",
        type=float,
        help="fraction of training pairs whose caption is emptied, so sampling can use --guidance "
        "(task.caption_dropout; default 0, the paper's)",
    )
    tr.add_argument("--resume", action="store_true", help="continue the run in --out")
    add_overrides_argument(tr, "config overrides, e.g. task.dalle.num_layers=6 task.dalle.attention=sparse")

    sp = sub.add_parser(
        "sample",
        help="generate images for a prompt with a trained checkpoint",
        description="sample image tokens after PROMPT (top-k / top-p, seeded), decode them with the "
        "checkpoint's dVAE and write them best first (sample_000.png) by the --rerank order, with "
        "ranking.json naming the re-ranker and each candidate's score",
    )
    sp.add_argument("prompt", help='the text, e.g. "a red circle at the top left"')
    sp.add_argument("--checkpoint", required=True, help="a `generate train` run or checkpoint directory")
    sp.add_argument("--n", type=int, default=8, help="images to generate")
    sp.add_argument("--out", required=True, help="folder for sample_000.png, ...")
    sp.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    sp.add_argument("--top-p", type=float, default=0.9, help="nucleus mass (1 = off)")
    sp.add_argument("--temperature", type=float, default=1.0, help="softmax temperature")
    sp.add_argument(
        "--guidance",
        type=float,
        default=1.0,
        help="classifier-free guidance scale (1 = off; above 1 follows the prompt more closely and needs a "
        "model trained with --caption-dropout)",
    )
    sp.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same images)")
    add_rerank_arguments(sp, "likelihood")
    sp.add_argument(
        "--contrast",
        action="append",
        default=[],
        metavar="TEXT",
        help="with --rerank contrastive: another prompt to contrast with (repeat the flag)",
    )

    ev = sub.add_parser(
        "evaluate",
        help="prompt accuracy of a checkpoint, judged by a trained detector, against random tokens",
        description="generate --n images per prompt, re-rank them, and check with a trained detector that "
        "every prompted colour and shape is there (DALL-Eval); the same for images decoded from random "
        "tokens and for each prompt's image judged against the next prompt",
    )
    ev.add_argument("--checkpoint", required=True, help="a `generate train` run or checkpoint directory")
    ev.add_argument("--detector", required=True, help="a `xmodal detector train` directory (e.g. RUN/best)")
    ev.add_argument("--prompts", required=True, help="text file, one held-out prompt per line")
    ev.add_argument("--n", type=int, default=8, help="candidates per prompt")
    add_rerank_arguments(ev, "likelihood")
    ev.add_argument("--threshold", type=float, default=0.5, help="detector class score that counts")
    ev.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    ev.add_argument("--top-p", type=float, default=0.9, help="nucleus mass (1 = off)")
    ev.add_argument("--temperature", type=float, default=1.0, help="softmax temperature")
    ev.add_argument(
        "--guidance",
        type=float,
        default=1.0,
        help="classifier-free guidance scale (1 = off; above 1 follows the prompt more closely and needs a "
        "model trained with --caption-dropout)",
    )
    ev.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    ev.add_argument(
        "--fid-weights",
        metavar="PATH",
        help="torch-fidelity's Inception-v3 weights file (weights-inception-2015-12-05-6726825d.pth); "
        "with --fid-images, FID of the best-ranked samples (else skipped with the reason; never downloaded)",
    )
    ev.add_argument("--fid-images", metavar="DIR", help="folder of real images FID compares the samples with")
    ev.add_argument("--json", action="store_true", help="print the result as one JSON object")

    tz = sub.add_parser(
        "tokenize",
        help="extract the images' token grids into an image-token store (a Ray job, resumable)",
        description="encode every image of the folders with a trained dVAE into an image-token store (one "
        "record per image: its token grid), by the same Ray job as `xmodal extract`: decoder actors, dVAE "
        "replicas, bad images retried alone then recorded in NAME.errors.jsonl, NAME.summary.json beside "
        "the store; an existing store is resumed (ids already in it are skipped)",
    )
    tz.add_argument("--images", required=True, nargs="+", help="image folders, list files or images")
    tz.add_argument("--tokenizer", required=True, help="train-tokenizer run (its best/) or dVAE directory")
    tz.add_argument("--out", required=True, help="image-token store directory")
    tz.add_argument("--batch-size", type=int, default=64, help="images encoded at once")
    tz.add_argument("--recursive", action="store_true", help="descend into sub-folders")
    tz.add_argument("--workers", type=int, help="dVAE replicas (default: one per GPU, else one)")
    tz.add_argument(
        "--cpus-per-worker",
        type=float,
        help="CPUs each replica reserves (default: those left after decoding)",
    )
    tz.add_argument("--address", help="Ray cluster to join (default: a private local instance)")
    tz.add_argument(
        "--max-failures", type=int, default=0, help="unreadable images tolerated before exit status 2"
    )
    tz.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _resolve_run(args: argparse.Namespace, run_cls, task_cls, default_train_config, task_flags: dict):
    """preset defaults < --config (or the run's config.yaml on --resume) < flags < KEY=VALUE."""
    from pipelines.engine import config_io

    config_path = args.config
    if config_path is None and args.resume and (Path(args.out) / "config.yaml").is_file():
        config_path = Path(args.out) / "config.yaml"
    preset = args.preset
    if preset is None and config_path is not None:
        preset = (config_io.load_yaml(config_path).get("task") or {}).get("preset")
    preset = preset or "small"
    cfg = run_cls(train=default_train_config(preset), task=task_cls(preset=preset))
    cfg = config_io.load(run_cls, config_path, base=cfg)
    train = {"max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed}
    data = {
        "train": {k: v for k, v in train.items() if v is not None},
        "task": {k: v for k, v in {**task_flags, "preset": args.preset}.items() if v is not None},
    }
    return config_io.apply_overrides(config_io.merge(cfg, data, where="command line"), args.overrides)


def resolve_tokenizer_config(args: argparse.Namespace):
    """The dVAE run's settings (see `_resolve_run`); the images are required."""
    from pipelines.tasks.generation import TokenizerRun, TokenizerTaskConfig, default_train_config

    cfg = _resolve_run(args, TokenizerRun, TokenizerTaskConfig, default_train_config, {"images": args.images})
    if not cfg.task.images:
        raise ValueError("--images is required (or task.images in --config)")
    return fit_schedule_to_run(cfg)


def fit_schedule_to_run(cfg):
    """End the temperature and KL annealing within the run when --max-steps is shorter than the preset's
    schedule (fields set in task.dvae are kept): otherwise the run stops at a temperature near 1, the
    decoder never learns from near one-hot codes, and the argmax tokens decode poorly (on the demo's
    scenes, with the earlier Gumbel recipe: 13.7 dB held-out PSNR for 200 steps of a 1500-step schedule,
    16.8 dB with it ended at 200)."""
    from model.dalle import DVAEConfig

    dvae = DVAEConfig.preset(cfg.task.preset, **cfg.task.dvae)
    steps = cfg.train.max_steps
    for name in ("temperature_anneal_steps", "kl_anneal_steps"):
        if name not in cfg.task.dvae and getattr(dvae, name) > steps:
            log.info("task.dvae.%s %d -> %d (the run's max_steps)", name, getattr(dvae, name), steps)
            cfg.task.dvae[name] = steps
    return cfg


def resolve_train_config(args: argparse.Namespace):
    """The transformer run's settings (see `_resolve_run`)."""
    from pipelines.tasks.text_to_image import TextToImageRun, TextToImageTaskConfig, default_train_config

    flags = {
        "features": args.features,
        "captions": args.captions,
        "tokenizer": args.tokenizer,
        "caption_dropout": args.caption_dropout,
    }
    return _resolve_run(args, TextToImageRun, TextToImageTaskConfig, default_train_config, flags)


def _train(args: argparse.Namespace) -> int:
    from pipelines.data.captions import CaptionDataError
    from pipelines.engine.launch import fit
    from pipelines.tasks.text_to_image import TextToImageTask
    from storage.errors import StoreError

    out = Path(args.out)
    try:
        cfg = resolve_train_config(args)
        summary = fit(TextToImageTask(cfg.task), cfg.train, out, resume=args.resume)
    except (ValueError, KeyError, OSError, FloatingPointError, StoreError, CaptionDataError) as exc:
        print(f"xmodal generate train: {str(exc).splitlines()[-1]}", file=sys.stderr)
        return 1
    best = summary.get("best")
    if best:
        print(
            f"trained to step {summary['step']}; best image-token log-likelihood {best['value']:.3f} "
            f"at step {best['step']}: {out}"
        )
    else:
        print(f"trained to step {summary['step']}: {out / 'last'}")
    return 0


def run(args: argparse.Namespace) -> int:
    return {
        "train-tokenizer": _train_tokenizer,
        "tokenize": _tokenize,
        "train": _train,
        "sample": _sample,
        "evaluate": _evaluate,
    }[args.action](args)


def _evaluate(args: argparse.Namespace) -> int:
    import json

    from extraction.weights import CheckpointError
    from pipelines.apps.generate.evaluate import EvalSettings, evaluate, load_detector, load_fid, read_prompts
    from pipelines.apps.generate.sample import SampleSettings
    from pipelines.data.captions import CaptionDataError
    from pipelines.tasks.text_to_image import TextToImageModel

    try:
        sampling = SampleSettings(args.n, args.top_k, args.top_p, args.temperature, args.seed, args.guidance)
        settings = EvalSettings(sampling, args.rerank, args.threshold)
        prompts = read_prompts(args.prompts)
        model = TextToImageModel.load(args.checkpoint)
        detector = load_detector(args.detector, settings)
        judge, reranker = load_judge(args)
        fid_inputs = load_fid(args.fid_weights, args.fid_images, model.dvae.config.image_size)
        result = evaluate(model, detector, prompts, settings, judge, reranker, fid_inputs)
    except (ValueError, OSError, CaptionDataError, CheckpointError) as exc:
        print(f"xmodal generate evaluate: {str(exc).splitlines()[-1]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    for key in (
        "prompt_accuracy",
        "sample_accuracy",
        "best_of_n_accuracy",
        "random_token_accuracy",
        "other_prompt_accuracy",
        "fid",
    ):
        value = result[key]
        print(f"{key:24s} {'n/a' if value is None else f'{value:.3f}'}")
    print(
        f"{result['prompts']} prompts ({result['prompts_left_out']} left out), "
        f"{result['samples_per_prompt']} samples each, re-ranked by {result['reranker']}"
    )
    if result["fid_skipped"]:
        print(f"FID skipped: {result['fid_skipped']}")
    return 0


def load_judge(args: argparse.Namespace):
    """The model re-ranker and its description for `--rerank captioner|matching`; (None, method) else."""
    flags = {
        "captioner": (args.captioner, args.captioner_detector),
        "matching": (args.matcher, args.matcher_detector),
    }
    for method, (model, detector) in flags.items():
        if args.rerank != method and (model or detector):
            flag = "--captioner" if method == "captioner" else "--matcher"
            raise ValueError(f"{flag} and {flag}-detector go with --rerank {method}")
    if args.rerank not in flags:
        return None, args.rerank
    model, detector = flags[args.rerank]
    if args.rerank == "captioner":
        if not model:
            raise ValueError("--rerank captioner needs --captioner RUN (a captioning run's best/)")
        from pipelines.apps.generate.rerank_captioner import CaptionerReranker as Reranker
    else:
        if not model:
            raise ValueError("--rerank matching needs --matcher RUN (a retrieval run's best/)")
        from pipelines.apps.generate.rerank_matching import MatchingReranker as Reranker
    judge = Reranker.load(model, detector)
    return judge, judge.source


def _tokenize(args: argparse.Namespace) -> int:
    from pipelines.jobs.extract.config import JobError
    from pipelines.jobs.tokenize import TokenizeConfig, run_tokenize
    from storage.errors import StoreError

    cfg = TokenizeConfig(
        images=args.images,
        tokenizer=args.tokenizer,
        out=args.out,
        batch_size=args.batch_size,
        recursive=args.recursive,
        workers=args.workers,
        cpus_per_worker=args.cpus_per_worker,
        address=args.address,
        max_failures=args.max_failures,
        progress=args.progress,
    )
    try:
        s = run_tokenize(cfg)
    except (ValueError, KeyError, OSError, StoreError, JobError) as exc:
        print(f"xmodal generate tokenize: {str(exc).splitlines()[-1]}", file=sys.stderr)
        return 1
    print(
        f"{s.written} token grids written, {s.skipped_present} already stored, {s.failed} unreadable "
        f"(see {s.errors}) of {s.total} images by {s.replicas} {s.device} replica(s), "
        f"{s.images_per_s:g} images/s: {args.out}"
    )
    return s.exit_code


def _train_tokenizer(args: argparse.Namespace) -> int:
    from pipelines.engine.launch import fit
    from pipelines.tasks.generation import TokenizerTask

    out = Path(args.out)
    try:
        cfg = resolve_tokenizer_config(args)
        task = TokenizerTask(cfg.task, grad_accum=cfg.train.grad_accum)
        summary = fit(task, cfg.train, out, resume=args.resume)
    except (ValueError, KeyError, OSError, FloatingPointError) as exc:
        print(f"xmodal generate train-tokenizer: {str(exc).splitlines()[-1]}", file=sys.stderr)
        return 1
    best = summary.get("best")
    if best:
        print(
            f"trained to step {summary['step']}; best PSNR {best['value']:.2f} dB "
            f"at step {best['step']}: {out}"
        )
    else:
        print(f"trained to step {summary['step']}: {out / 'last'}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    import json

    from extraction.weights import CheckpointError
    from pipelines.apps.generate.rerank import rank, rerank_scores
    from pipelines.apps.generate.sample import (
        SampleSettings,
        decode,
        prompt_cut,
        prompt_unknown,
        sample_tokens,
        write_images,
    )
    from pipelines.data.captions import CaptionDataError
    from pipelines.tasks.text_to_image import TextToImageModel

    try:
        settings = SampleSettings(args.n, args.top_k, args.top_p, args.temperature, args.seed, args.guidance)
        model = TextToImageModel.load(args.checkpoint)
        for note in (prompt_unknown(model, args.prompt), prompt_cut(model, args.prompt)):
            if note:
                print(f"xmodal generate sample: warning: {note}", file=sys.stderr)
        judge, reranker = load_judge(args)
        tokens = sample_tokens(model, args.prompt, settings)
        scores = rerank_scores(model, args.prompt, tokens, args.rerank, args.contrast, judge)
        order = rank(scores)
        images = decode(model, tokens)
        paths = write_images([images[i] for i in order], args.out)
        ranking = {
            "prompt": args.prompt,
            "reranker": reranker,
            "candidates": [
                {"file": p.name, "sample": i, "score": float(scores[i])}
                for p, i in zip(paths, order, strict=True)
            ],
        }
        (Path(args.out) / "ranking.json").write_text(json.dumps(ranking, indent=1) + "\n")
    except (ValueError, OSError, CaptionDataError, CheckpointError) as exc:
        print(f"xmodal generate sample: {str(exc).splitlines()[-1]}", file=sys.stderr)
        return 1
    print(f"{len(paths)} images for {args.prompt!r}, best first by {reranker}: {args.out}")
    return 0
