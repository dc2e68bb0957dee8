"""`xmodal convert KIND`: bring released detector and model checkpoints into xmodal's layout."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from extraction.config import DEFAULT_PRESET as DETECTOR_PRESET
    from extraction.config import PRESETS as DETECTOR_PRESETS

    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    det = sub.add_parser("detector", help="detectron2 .pkl / HuggingFace .bin / safetensors -> safetensors")
    det.add_argument("src", help="faster_rcnn_from_caffe_attr.pkl, pytorch_model.bin or .safetensors")
    det.add_argument("dst", help="output .safetensors file")
    det.add_argument("--no-strict", dest="strict", action="store_false", help="allow missing/unexpected keys")
    det.add_argument(
        "--preset",
        default=DETECTOR_PRESET,
        choices=sorted(DETECTOR_PRESETS),
        help=f"the network the checkpoint is checked against (default: {DETECTOR_PRESET})",
    )
    lx = sub.add_parser("lxmert", help="original release / HuggingFace LXMERT -> xmodal directory (or back)")
    lx.add_argument(
        "src",
        help="Epoch20_LXRT.pth, model_LXRT.pth, BEST.pth, an LXRTEncoder.save file (NAME_LXRT.pth, "
        "the encoder alone), or a HuggingFace or xmodal dir",
    )
    lx.add_argument("dst", help="output directory")
    lx.add_argument(
        "--to-hf",
        action="store_true",
        help="export to the HuggingFace layout, with the tokenizer files and id2label/label2id, so "
        "transformers' AutoTokenizer and Lxmert* classes load DST as it is",
    )
    lx.add_argument(
        "--vocab",
        help="with --to-hf: the vocab.txt to write as DST's tokenizer (default: SRC's vocab.txt; the release "
        "was trained with bert-base-uncased's)",
    )
    lx.add_argument(
        "--answers",
        metavar="FILE",
        help="the QA head's answer table (all_ans.json for Epoch20_LXRT.pth, trainval_ans2label.json for a "
        "VQA BEST.pth): checked against the head's rows and written as DST/ans2label.json, from which "
        "`xmodal finetune --init DST` seeds its answer head",
    )
    vb = sub.add_parser("vilbert", help="vilbert-multi-task / volta ViLBERT file -> xmodal directory")
    vb.add_argument("src", help="pretrained_model.bin, multi_task_model.bin or a volta checkpoint")
    vb.add_argument("dst", help="output directory")
    vb.add_argument(
        "--config",
        metavar="FILE",
        help="the release's model config (bert_base_6layer_6conect.json, volta's vilbert_base.json); "
        "default: the base preset",
    )
    vb.add_argument("--preset", default="base", help="sizes to start from before --config (default: base)")
    vb.add_argument(
        "--head",
        help="model to build: backbone, pretraining, vqa, gqa (vil_prediction_gqa), nlvr2 or retrieval "
        "(default: vqa with vil_prediction in the file, else pretraining, else backbone)",
    )
    vb.add_argument(
        "--task-token", type=int, help="task row of multi_task_model.bin's task embeddings (VQA: 1)"
    )
    vb.add_argument(
        "--no-strict", dest="strict", action="store_false", help="write even with missing/unexpected names"
    )
    vl = sub.add_parser(
        "vlbert", help="VL-BERT release checkpoint ({'state_dict'}, module.*) -> xmodal directory"
    )
    vl.add_argument("src", help="a jackroos/VL-BERT .model file (pre-trained or VQA fine-tuned)")
    vl.add_argument("dst", help="output directory")
    vl.add_argument(
        "--num-attention-heads",
        type=int,
        default=None,
        metavar="N",
        help="the file does not store it: hidden size / 64 unless given (12 for base, 16 for large)",
    )
    vsb = sub.add_parser(
        "visualbert", help="transformers VisualBERT directory -> xmodal directory (or back with --to-hf)"
    )
    vsb.add_argument(
        "src",
        help="a transformers directory (config.json and model.safetensors or pytorch_model.bin), or "
        "with --to-hf an xmodal one (runs/vqa/best)",
    )
    vsb.add_argument("dst", help="output directory")
    vsb.add_argument(
        "--to-hf",
        action="store_true",
        help="export to transformers' layout, with the tokenizer files and id2label/label2id, so "
        "AutoTokenizer and transformers' VisualBert* classes load DST as it is",
    )
    vsb.add_argument(
        "--visual-token-type",
        type=int,
        choices=(0, 1),
        help="the token type SRC's regions were trained with, recorded in DST and used wherever it is tuned, "
        "evaluated or served (default: 0 for uclanlp/visualbert's releases, named so in SRC's path as the "
        "hub stores them, whose code feeds 0; else 1, as transformers feeds)",
    )
    vsb.add_argument("--vocab", help="with --to-hf: the vocab.txt to write (default: SRC's vocab.txt)")
    vsb.add_argument(
        "--answers",
        metavar="FILE",
        help="with --to-hf: the QA head's answer table (default: SRC's ans2label.json)",
    )


def run(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    try:
        if args.kind == "detector":
            from extraction.weights import convert_detector_checkpoint

            convert_detector_checkpoint(args.src, args.dst, strict=args.strict, preset=args.preset)
        elif args.kind == "vilbert":
            _convert_vilbert(args)
        elif args.kind == "vlbert":
            from model.vlbert import convert_vlbert

            print(f"{convert_vlbert(args.src, args.dst, args.num_attention_heads)}: converted")
        elif args.kind == "visualbert":
            _convert_visualbert(args)
        else:
            _convert_lxmert(args)
    except (ValueError, OSError, SafetensorError) as exc:
        # a missing, corrupt or mismatched file is the user's to fix: one line, the details under -v
        log.debug("details", exc_info=True)
        print(f"xmodal convert {args.kind}: {_one_line(exc, args.src)}", file=sys.stderr)
        return 1
    return 0


def _hf_extras(args: argparse.Namespace, src: Path):
    """The answer table (`--answers`, or with --to-hf SRC's) and, with --to-hf, the tokenizer to write:
    read before anything is written, so a bad one fails first."""
    from pipelines.data.answers import ANSWERS_FILE, AnswerTable
    from pipelines.data.text import load_tokenizer

    table = AnswerTable.load(args.answers) if args.answers else None
    if table is None and args.to_hf and (src / ANSWERS_FILE).is_file():
        table = AnswerTable.load(src / ANSWERS_FILE)
    if not args.to_hf:
        if args.vocab:
            raise ValueError("--vocab only applies with --to-hf")
        return None, table
    # a HuggingFace directory without its tokenizer maps every word to [UNK]
    vocab = args.vocab or (src / "vocab.txt" if (src / "vocab.txt").is_file() else None)
    if vocab is None:
        raise ValueError(
            f"{src} has no vocab.txt for the exported tokenizer: pass --vocab (bert-base-uncased's "
            "vocab.txt for the release files)"
        )
    return load_tokenizer(vocab), table


def _convert_visualbert(args: argparse.Namespace) -> None:
    from model.visualbert import convert_visualbert

    if args.answers and not args.to_hf:
        raise ValueError("--answers only applies with --to-hf (a transformers directory names its answers)")
    tokenizer, table = _hf_extras(args, Path(args.src))
    num_answers = len(table) if table is not None else None
    dst = convert_visualbert(
        args.src,
        args.dst,
        to_hf=args.to_hf,
        num_answers=num_answers,
        visual_token_type_id=args.visual_token_type,
    )
    if tokenizer is not None:
        _finish_hf_directory(Path(dst), tokenizer, table)
    elif (Path(args.src) / "vocab.txt").is_file():  # fine-tuning from dst then uses the model's vocabulary
        shutil.copyfile(Path(args.src) / "vocab.txt", Path(dst) / "vocab.txt")
    print(f"{dst}: converted")


def _convert_lxmert(args: argparse.Namespace) -> None:
    from model import convert_lxmert
    from pipelines.data.answers import ANSWERS_FILE

    src = Path(args.src)
    tokenizer, table = _hf_extras(args, src)
    dst = convert_lxmert(
        args.src, args.dst, to_hf=args.to_hf, num_answers=len(table) if table is not None else None
    )
    if tokenizer is not None:
        _finish_hf_directory(Path(dst), tokenizer, table)
    elif (src / "vocab.txt").is_file():  # a HuggingFace directory's vocabulary: fine-tuning from dst uses it
        shutil.copyfile(src / "vocab.txt", Path(dst) / "vocab.txt")
    if table is not None and not args.to_hf:
        table.save(Path(dst) / ANSWERS_FILE)
        print(f"{dst}: converted, with the {len(table)}-answer table of {args.answers} as {ANSWERS_FILE}")
    else:
        print(f"{dst}: converted")


def _finish_hf_directory(dst: Path, tokenizer, table) -> None:
    """The tokenizer files, and the answers as `id2label`/`label2id` in config.json."""
    import json

    from pipelines.data.text import save_tokenizer

    save_tokenizer(tokenizer, dst)
    if table is not None:
        config = json.loads((dst / "config.json").read_text())
        config["id2label"] = {str(i): a for i, a in enumerate(table.answers)}
        config["label2id"] = {a: i for i, a in enumerate(table.answers)}
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _convert_vilbert(args: argparse.Namespace) -> None:
    from model.vilbert import load_release

    model, report = load_release(
        args.src,
        preset=args.preset,
        config_file=args.config,
        head=args.head,
        task_token=args.task_token,
        strict=args.strict,
    )
    dst = model.save_pretrained(args.dst)
    print(f"{dst}: converted\n{report.summary(dropped=args.verbose)}")


def _one_line(exc: BaseException, src: str) -> str:
    """The error on one line, naming the file: a detector load report becomes its counts."""
    from extraction.weights import CheckpointError

    if isinstance(exc, CheckpointError) and exc.report is not None:
        summary = exc.report.summary()
        counts = ", ".join(f"{summary[k]} {k}" for k in ("missing", "unexpected", "mismatched") if summary[k])
        message = (
            f"checkpoint {exc.report.source}: {counts} (-v lists them); "
            "fix the checkpoint or pass --no-strict to write the matching tensors only"
        )
    else:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        message = lines[0] if len(lines) == 1 else f"{lines[0]} (-v shows the rest)"
    return message if str(src) in message else f"{src}: {message}"
