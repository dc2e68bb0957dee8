"""`xmodal vocab build`: train a lowercase WordPiece vocab.txt for users without hub access."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="train a WordPiece vocab from your text, question or caption files")
    build.add_argument(
        "corpus",
        nargs="+",
        help="text files (one sentence per line), question rows (CSV/TSV, JSON, JSON lines, Parquet: "
        "`question` or `sent`), caption files ({image, caption} rows, Karpathy's dataset_*.json, COCO's "
        "captions_*.json) or pre-training JSON",
    )
    build.add_argument("--out", required=True, help="vocab.txt to write")
    build.add_argument("--vocab-size", type=int, default=None, help="target size (default: BERT's 30522)")


def run(args: argparse.Namespace) -> int:
    from pipelines.data.text import DEFAULT_VOCAB_SIZE, build_vocab, load_tokenizer

    try:
        out = build_vocab(args.corpus, args.out, args.vocab_size or DEFAULT_VOCAB_SIZE)
    except (OSError, ValueError) as exc:
        print(f"xmodal vocab build: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({len(load_tokenizer(out))} tokens)")
    return 0
