"""`xmodal convert detector|lxmert`: bring released checkpoints into xmodal's safetensors layout."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    det = sub.add_parser("detector", help="detectron2 .pkl / HuggingFace .bin / safetensors -> safetensors")
    det.add_argument("src", help="faster_rcnn_from_caffe_attr.pkl, pytorch_model.bin or .safetensors")
    det.add_argument("dst", help="output .safetensors file")
    det.add_argument("--no-strict", dest="strict", action="store_false", help="allow missing/unexpected keys")
    lx = sub.add_parser("lxmert", help="original release / HuggingFace LXMERT -> xmodal directory (or back)")
    lx.add_argument("src", help="Epoch20_LXRT.pth, model_LXRT.pth, BEST.pth, or a HuggingFace or xmodal dir")
    lx.add_argument("dst", help="output directory")
    lx.add_argument("--to-hf", action="store_true", help="export an xmodal dir to the HuggingFace layout")


def run(args: argparse.Namespace) -> int:
    if args.kind == "detector":
        from extraction.weights import convert_detector_checkpoint

        convert_detector_checkpoint(args.src, args.dst, strict=args.strict)
    else:
        from model.convert import convert_lxmert

        convert_lxmert(args.src, args.dst, to_hf=args.to_hf)
    return 0
