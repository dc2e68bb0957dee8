"""`xmodal convert detector|lxmert`: bring released checkpoints into xmodal's safetensors layout."""

from __future__ import annotations

import argparse
import logging
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
    lx.add_argument("src", help="Epoch20_LXRT.pth, model_LXRT.pth, BEST.pth, or a HuggingFace or xmodal dir")
    lx.add_argument("dst", help="output directory")
    lx.add_argument("--to-hf", action="store_true", help="export an xmodal dir to the HuggingFace layout")
    lx.add_argument(
        "--answers",
        metavar="FILE",
        help="the QA head's answer table (all_ans.json for Epoch20_LXRT.pth, trainval_ans2label.json for a "
        "VQA BEST.pth): checked against the head's rows and written as DST/ans2label.json, from which "
        "`xmodal finetune --init DST` seeds its answer head",
    )


def run(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    try:
        if args.kind == "detector":
            from extraction.weights import convert_detector_checkpoint

            convert_detector_checkpoint(args.src, args.dst, strict=args.strict, preset=args.preset)
        else:
            _convert_lxmert(args)
    except (ValueError, OSError, SafetensorError) as exc:
        # a missing, corrupt or mismatched file is the user's to fix: one line, the details under -v
        log.debug("details", exc_info=True)
        print(f"xmodal convert {args.kind}: {_one_line(exc, args.src)}", file=sys.stderr)
        return 1
    return 0


def _convert_lxmert(args: argparse.Namespace) -> None:
    from model import convert_lxmert
    from pipelines.data.answers import ANSWERS_FILE, AnswerTable

    table = AnswerTable.load(args.answers) if args.answers else None  # a bad table fails before any writing
    dst = convert_lxmert(
        args.src, args.dst, to_hf=args.to_hf, num_answers=len(table) if table is not None else None
    )
    if table is not None:
        table.save(Path(dst) / ANSWERS_FILE)
        print(f"{dst}: converted, with the {len(table)}-answer table of {args.answers} as {ANSWERS_FILE}")
    else:
        print(f"{dst}: converted")


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
