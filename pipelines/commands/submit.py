"""`xmodal submit --address http://HEAD:8265 -- COMMAND...`: run any xmodal command as a Ray Job."""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)

EPILOG = """\
example: xmodal submit --address http://HEAD:8265 -- extract /data/images --out /data/feats.lmdb

The working dir (default: .) is uploaded without caches (.venv, .git, runs, ...), weights (*.pt, *.bin,
*.safetensors, *.pkl, ...) and data (*.lmdb, *.h5, *.tsv, images, archives), which --include PATTERN puts
back, and never with secrets (.env*, .ssh/, SSH keys, *.pem, *.key, .netrc, cloud credentials, tokens) or
links that leave the folder or point to folders. What goes up, its size and what stayed home are printed
first, and more than Ray's upload limit (512 MiB) is refused before sending. Then
`python -m pipelines COMMAND...` (that is, `xmodal COMMAND...` from the uploaded code) runs on the head
with the cluster's Python, so paths must be valid there (shared storage). Logs stream here; the exit
status is the job's. Ctrl-C stops following, not the job. Clusters with token auth (Ray >= 2.60) get
the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS"),
        help="Ray dashboard (Jobs API) address, e.g. http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS)",
    )
    parser.add_argument("--working-dir", default=".", help="code folder to upload (default: .)")
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="upload files the defaults leave out, e.g. --include 'configs/*.pt' (gitignore syntax, "
        "repeatable)",
    )
    parser.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once the job is accepted"
    )
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the xmodal command to run"
    )


def run(args: argparse.Namespace) -> int:
    from pipelines.jobs.submission import submit_job

    argv = args.argv[1:] if args.argv[:1] == ["--"] else list(args.argv)
    if not argv:
        log.error(
            "nothing to submit: give the xmodal command after `--`, e.g. -- extract images/ --out f.lmdb"
        )
        return 1
    if not args.address:
        log.error("--address is required (the Ray dashboard, e.g. http://HEAD:8265)")
        return 1
    try:
        return submit_job(
            args.address, argv, working_dir=args.working_dir, wait=args.wait, include=args.include
        )
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 1
