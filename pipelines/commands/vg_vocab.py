"""The `--vocab DIR` option of the commands that draw regions: Visual Genome object and attribute names."""

from __future__ import annotations

import argparse
import os

VG_VOCAB_ENV = "XMODAL_VG_VOCAB"  # the VG vocabulary folder when --vocab is absent


def add_vg_vocab_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vocab",
        metavar="DIR",
        help="folder with the VG vocabularies, objects_vocab.txt and attributes_vocab.txt or vg_* "
        f'(default: ${VG_VOCAB_ENV}; with neither, ids are drawn instead of "attribute object" names)',
    )


def vg_vocab(directory: str | None) -> tuple[list[str] | None, list[str] | None]:
    """(object names, attribute names) from `directory`, else from $XMODAL_VG_VOCAB, else (None, None)."""
    from extraction.draw import load_vg_vocab

    if directory:
        return load_vg_vocab(directory)
    if os.environ.get(VG_VOCAB_ENV):
        try:
            return load_vg_vocab(os.environ[VG_VOCAB_ENV])
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{exc} (from ${VG_VOCAB_ENV}; fix it, unset it or pass --vocab)"
            ) from None
    return None, None
