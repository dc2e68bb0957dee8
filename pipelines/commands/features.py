"""`xmodal features info|ls|verify|import|export|merge|show`: inspect, convert and draw feature stores."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pipelines.commands.vg_vocab import add_vg_vocab_option, vg_vocab

log = logging.getLogger(__name__)

LS_LIMIT = 100
SHOW_MIN_SCORE = 0.5  # `features show` draws the regions the detector is this sure of, as the demo's pictures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for add in (_add_info, _add_ls, _add_verify, _add_import, _add_export, _add_merge, _add_show):
        add(sub)


def run(args: argparse.Namespace) -> int:
    from storage import StoreError

    try:
        return args._action(args)
    except (StoreError, FileNotFoundError, ValueError) as exc:
        # bad input and refusals are the user's to fix: the message, not a traceback (-v shows it)
        log.error("%s", exc)
        log.debug("details", exc_info=True)
        return 1


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="count, dims, dtype, size on disk and provenance of a store")
    p.add_argument("path", nargs="+", help="store directory (several shards are read as one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(_action=_info)


def _info(args: argparse.Namespace) -> int:
    from storage.info import describe, format_size

    meta = describe(args.path)
    if args.json:
        print(json.dumps(meta, sort_keys=True))
        return 0
    print(f"store      {', '.join(meta['paths'])}")
    print(f"format     {meta['format']} v{meta['format_version']}")
    print(f"records    {meta['count']}")
    print(f"features   {meta['max_boxes']} boxes max x {meta['feature_dim']} {meta['dtype']}")
    print(f"on disk    {format_size(meta['size_on_disk'])}")
    print(f"created    {meta['created_at']} by {meta['created_by']}")
    for key, value in sorted(meta["provenance"].items()):
        print(f"  {key}: {json.dumps(value)}")
    return 0


def _add_ls(sub) -> None:
    p = sub.add_parser("ls", help="list record ids (key order), a page at a time")
    p.add_argument("path", nargs="+", help="store directory (several shards are read as one)")
    p.add_argument("--offset", type=int, default=0, help="skip this many ids first (default: 0)")
    p.add_argument(
        "--limit", type=int, default=LS_LIMIT, help=f"ids to list, 0 for all (default: {LS_LIMIT})"
    )
    p.add_argument("--json", action="store_true", help='one JSON object: {"total", "offset", "ids"}')
    p.set_defaults(_action=_ls)


def _ls(args: argparse.Namespace) -> int:
    from itertools import islice

    from storage import FeatureReader

    if args.offset < 0 or args.limit < 0:
        raise ValueError("--offset and --limit must be 0 or more")
    reader = FeatureReader(args.path)
    stop = args.offset + args.limit if args.limit else None
    ids = list(islice(reader.keys(), args.offset, stop))
    total = len(reader)
    if args.json:
        print(json.dumps({"total": total, "offset": args.offset, "ids": ids}))
        return 0
    for img_id in ids:
        print(img_id)
    shown_to = args.offset + len(ids)
    if shown_to < total:
        print(f"# {args.offset + 1}-{shown_to} of {total}; next page: --offset {shown_to}", file=sys.stderr)
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check that every record decodes and matches its checksum")
    p.add_argument("path", nargs="+", help="store directory (several shards are checked together)")
    p.add_argument("--deep", action="store_true", help="also check values (finite, boxes, labels)")
    p.set_defaults(_action=_verify)


def _verify(args: argparse.Namespace) -> int:
    from storage.verify import verify

    report = verify(args.path, deep=args.deep)
    for img_id, reason in report.bad:
        print(f"BAD {img_id}: {reason}")
    for problem in report.problems:
        print(f"PROBLEM {problem}")
    print(f"{report.checked} records checked, {len(report.bad)} bad")
    return 0 if report.ok else 1


def _add_import(sub) -> None:
    from storage.formats import FORMATS

    p = sub.add_parser("import", help="feature .tsv or HDF5 (.h5/.hdf5) -> store")
    p.add_argument(
        "src",
        help="feature TSV (LXMERT's 10 fields or bottom-up-attention's 6, told apart per file), "
        "bottom-up-attention-vqa HDF5, or an xmodal HDF5 export",
    )
    p.add_argument("dst", help="store directory (created, or appended to: ids it holds are skipped)")
    p.add_argument("--format", choices=sorted(FORMATS), help="source format (default: from the extension)")
    p.add_argument(
        "--dtype", choices=("float16", "float32"), help="stored feature dtype (default: DST's, else float16)"
    )
    p.add_argument(
        "--max-boxes", type=int, help="most boxes per image (default: DST's, else the HDF5's width, else 36)"
    )
    p.add_argument(
        "--feature-dim", type=int, help="feature width (default: DST's, else the first record with boxes')"
    )
    p.add_argument("--ids", help="HDF5 only: id -> row map, JSON {id: row} / [ids] or text (one id per line)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed lines/rows instead of stopping")
    p.add_argument("--replace", action="store_true", help="overwrite ids the store already holds")
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse a source holding what no record would carry (HDF5: ids of rows it lacks, no labels)",
    )
    p.set_defaults(_action=_import)


def _import(args: argparse.Namespace) -> int:
    from storage.formats import format_of, options_for
    from storage.importer import import_records
    from storage.info import describe

    fmt = format_of(args.src, args.format)
    options = options_for(fmt, {"ids": args.ids}, fmt.read_options, "sources")
    dtype, max_boxes, feature_dim = "float16", 36, None
    if Path(args.dst, "data.mdb").is_file():
        meta = describe(args.dst)
        dtype, max_boxes, feature_dim = meta["dtype"], meta["max_boxes"], meta["feature_dim"]
    elif fmt.max_boxes is not None:
        max_boxes = fmt.max_boxes(args.src)
    report = import_records(
        fmt.read(args.src, **options),
        args.src,
        args.dst,
        dtype=args.dtype or dtype,
        max_boxes=args.max_boxes or max_boxes,
        feature_dim=args.feature_dim or feature_dim,
        skip_bad=args.skip_bad,
        replace=args.replace,
        provenance={"format": fmt.name, **fmt.describe(args.src)},
        source_provenance=fmt.source_provenance(args.src),
        strict=args.strict,
    )
    print(report.summary(args.dst))
    return 0


def _add_export(sub) -> None:
    from storage.formats import FORMATS

    p = sub.add_parser("export", help="store -> LXMERT .tsv or HDF5 (.h5/.hdf5)")
    p.add_argument("src", nargs="+", help="store directory (several shards are exported as one)")
    p.add_argument("dst", help="output .tsv, .h5 or .hdf5 file")
    p.add_argument("--format", choices=sorted(FORMATS), help="output format (default: from the extension)")
    p.add_argument("--dtype", choices=("float16", "float32"), help="HDF5 feature dtype (default: float32)")
    p.add_argument(
        "--skip-empty",
        action="store_true",
        help="TSV only: leave out records without boxes (refused otherwise)",
    )
    p.set_defaults(_action=_export)


def _export(args: argparse.Namespace) -> int:
    from storage import FeatureReader
    from storage.formats import format_of, options_for

    fmt = format_of(args.dst, args.format)
    options = options_for(
        fmt, {"skip_empty": args.skip_empty, "dtype": args.dtype}, fmt.write_options, "exports"
    )
    count = fmt.write(FeatureReader(args.src), args.dst, **options)
    print(f"{args.dst}: {count} records exported ({fmt.name})")
    return 0


def _add_merge(sub) -> None:
    p = sub.add_parser("merge", help="combine stores (extraction shards) into one")
    p.add_argument("src", nargs="+", help="source stores (a single one is copied and checked)")
    p.add_argument("dst", help="destination store (created, or appended to after an interrupted merge)")
    p.add_argument("--first-wins", action="store_true", help="for ids in several sources keep the first copy")
    p.add_argument(
        "--salvage",
        action="store_true",
        help="copy what damaged sources still hold, logging each broken page and corrupt record left out "
        "(re-extract those ids: extraction skips the stored ones)",
    )
    p.set_defaults(_action=_merge)


def _merge(args: argparse.Namespace) -> int:
    from pipelines.cli import EXIT_PARTIAL
    from storage.merge import merge_stores

    merged = merge_stores(args.src, args.dst, first_wins=args.first_wins, salvage=args.salvage)
    print(f"{args.dst}: {merged.written} records written from {len(args.src)} sources")
    if merged.left_out:
        print(
            f"{args.dst}: PARTIAL: {len(merged.left_out)} damaged pages or records left out (listed above); "
            "re-extract into it with `xmodal extract --out` (stored ids are skipped)",
            file=sys.stderr,
        )
        return EXIT_PARTIAL
    return 0


def _add_show(sub) -> None:
    p = sub.add_parser("show", help='draw one record\'s boxes with "attribute object" labels on its image')
    p.add_argument("path", help="store directory")
    p.add_argument("img_id", help="record id")
    p.add_argument("--image", required=True, help="the image the record was extracted from")
    p.add_argument("--out", required=True, help="output image (.png or .jpg)")
    p.add_argument(
        "--min-score",
        type=float,
        default=SHOW_MIN_SCORE,
        metavar="S",
        help=f"draw the regions whose object score is at least S, and always the best one (default "
        f"{SHOW_MIN_SCORE}, as the demo's pictures; 0 draws them all)",
    )
    add_vg_vocab_option(p)
    p.set_defaults(_action=_show)


def _show(args: argparse.Namespace) -> int:
    import cv2
    import numpy as np

    from extraction import load_image
    from extraction.draw import draw_regions
    from storage import FeatureReader

    reader = FeatureReader(args.path)
    if args.img_id not in reader:
        raise ValueError(f"{args.path}: no record {args.img_id!r}; `xmodal features ls` lists its ids")
    rec = reader[args.img_id]
    objects, attributes = vg_vocab(args.vocab)
    if objects is None:  # the names the store's detector weights carry, if they do
        from extraction.provenance import recorded_names

        objects, attributes = recorded_names(reader.shards[0].read_meta().get("provenance", {}))
    picture = load_image(args.image)
    height, width = picture.shape[:2]
    if (height, width) != (rec.img_h, rec.img_w):  # boxes of another size land in the wrong places
        raise ValueError(
            f"{args.image} is {width}x{height} but {args.img_id!r} was extracted from a "
            f"{rec.img_w}x{rec.img_h} picture; give the image the record was extracted from"
        )
    if not 0.0 <= args.min_score <= 1.0:
        raise ValueError(f"--min-score {args.min_score}: give a score between 0 and 1")
    order = np.argsort(-rec.objects_conf, kind="stable")
    order = order[: max(1, int((rec.objects_conf >= args.min_score).sum()))] if rec.num_boxes else order
    drawn = draw_regions(picture, rec, objects, attributes, regions=order, show_conf=True).image
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(args.out), drawn):
        raise ValueError(f"cannot write {args.out}: use a .png or .jpg name in a writable folder")
    print(
        f"{args.out}: {len(order)} of the {rec.num_boxes} regions of {args.img_id!r} drawn (object score "
        f">= {args.min_score:g}, and the best one; --min-score 0 draws them all)"
    )
    return 0
