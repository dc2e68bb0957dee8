"""`xmodal ask IMAGE QUESTION`: the detector and a fine-tuned VQA/GQA model answer a question on an image;
`xmodal ask IMAGE --caption`: a fine-tuned captioner describes it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipelines.commands.vg_vocab import add_vg_vocab_option, vg_vocab


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipelines.apps.ask import DEFAULT_TOP_K
    from pipelines.engine.devices import DEFAULT_DEVICE, DEVICE_HELP

    parser.add_argument("image", help="image file")
    parser.add_argument(
        "question", nargs="?", help='the question, e.g. "what is the man holding?" (none with --caption)'
    )
    parser.add_argument(
        "--checkpoint", required=True, help="fine-tuned VQA/GQA (runs/vqa/best) or captioning directory"
    )
    parser.add_argument(
        "--caption",
        action="store_true",
        help="describe the image with a captioning checkpoint; --explain then draws each word's attention",
    )
    parser.add_argument("--beam-size", type=int, default=3, help="beam width for --caption (default: 3)")
    parser.add_argument(
        "--weights",
        help="detector checkpoint; default: the one the training features were made with if it exists, "
        "else random weights (meaningless answers, for tests)",
    )
    parser.add_argument(
        "--top-k", type=int, default=DEFAULT_TOP_K, help=f"answers to print (default: {DEFAULT_TOP_K})"
    )
    parser.add_argument("--explain", metavar="OUT.png", help="draw the regions the answer attended to most")
    add_vg_vocab_option(parser)
    parser.add_argument(
        "--json",
        metavar="FILE",
        help='also write {"image", "question", "answers": [{"answer", "score"}], "explain"} to FILE '
        "(- prints only that JSON object)",
    )
    parser.add_argument(
        "--min-size", type=int, help="detector input shortest side (default: as recorded, 600)"
    )
    parser.add_argument(
        "--max-size", type=int, help="detector input longest side (default: as recorded, 1000)"
    )
    parser.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)


def run(args: argparse.Namespace) -> int:
    from pipelines.apps.ask import ask_image

    if args.caption:
        return _caption(args)
    if args.question is None:
        print("xmodal ask: give a question, or --caption to describe the image", file=sys.stderr)
        return 1
    try:
        object_names, attr_names = vg_vocab(args.vocab) if args.explain else (None, None)
        result = ask_image(
            args.image,
            args.question,
            args.checkpoint,
            weights=args.weights,
            top_k=args.top_k,
            explain=args.explain,
            device=args.device,
            object_names=object_names,
            attr_names=attr_names,
            min_size=args.min_size,
            max_size=args.max_size,
        )
    except (ValueError, FileNotFoundError) as exc:  # ImageError is a ValueError
        print(f"xmodal ask: {exc}", file=sys.stderr)
        return 1
    if args.json:
        text = json.dumps(_as_json(args, result.answers), indent=1)
        if args.json == "-":
            print(text)
            return 0
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(f"Q: {args.question}")
    for answer, score in result.answers:
        print(f"{score:7.3f}  {answer}")
    if args.explain:
        print(f"attended regions drawn to {args.explain}")
    return 0


def _as_json(args: argparse.Namespace, answers: list[tuple[str, float]]) -> dict:
    return {
        "image": args.image,
        "question": args.question,
        "answers": [{"answer": a, "score": s} for a, s in answers],
        "explain": args.explain,
    }


def _caption(args: argparse.Namespace) -> int:
    from pipelines.apps.caption import caption_image

    if args.question is not None:
        print("xmodal ask: --caption takes no question; drop one of them", file=sys.stderr)
        return 1
    try:
        result = caption_image(
            args.image,
            args.checkpoint,
            weights=args.weights,
            explain=args.explain,
            beam_size=args.beam_size,
            device=args.device,
            min_size=args.min_size,
            max_size=args.max_size,
        )
    except (ValueError, FileNotFoundError) as exc:  # ImageError is a ValueError
        print(f"xmodal ask: {exc}", file=sys.stderr)
        return 1
    if args.json:
        text = json.dumps(
            {"image": args.image, "caption": result.caption, "words": result.words, "explain": args.explain},
            indent=1,
        )
        if args.json == "-":
            print(text)
            return 0
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(result.caption)
    if args.explain:
        print(f"each word's attended regions drawn to {args.explain}")
    return 0
