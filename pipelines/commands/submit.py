"""`xmodal submit --address http://HEAD:8265 -- COMMAND...`: run any xmodal command as a Ray Job."""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)

EPILOG = """\
example: xmodal submit --address http://HEAD:8265 -- extract /data/images --out /data/feats.lmdb

The working dir (default: .) is uploaded without caches (.venv, .git, runs, ...), weights (*.pt, *.bin,
*.safetensors, *.pkl, ...) and data (*.lmdb, *.h5, *.tsv, images, archives, *.whl; any case: .JPG too),
which --include PATTERN puts back, and never with secrets (.env*, .ssh/, SSH keys, *.pem, *.key, .netrc,
cloud credentials, tokens), links that leave the folder or point to folders, or files hard-linked from
outside it. The package is zipped here from exactly the files listed. What goes up, its size and what
stayed home are printed first; --dry-run prints every file and the command as it will run, and sends
nothing. Then `python -m pipelines COMMAND...` (that is, `xmodal COMMAND...` from the uploaded code) runs
on the head with the cluster's Python, in a temporary copy of the working dir that Ray deletes
afterwards. So before anything is sent, and all listed at once: more than Ray's upload limit (512 MiB)
is refused, --out must be absolute (a path on the cluster's shared storage), and a relative input must
exist, be inside the working dir and be uploaded (it is then given relative to it); absolute paths are
the cluster's. Logs stream here; the exit status is the job's, and a job that succeeds ends with one line
naming its outputs on the cluster. Ctrl-C stops following, not the job. Clusters with token auth
(Ray >= 2.60) get the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.
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
        "--dry-run",
        action="store_true",
        help="print every file to upload, what stays home and the command as it will run; send nothing",
    )
    parser.add_argument("--submission-id", help="the job's id (default: Ray picks one)")
    parser.add_argument(
        "--entrypoint-num-cpus", type=float, help="CPUs reserved for the job's driver (as `ray job submit`)"
    )
    parser.add_argument(
        "--entrypoint-num-gpus",
        type=float,
        help="GPUs reserved for the driver, e.g. 1 to run a training without --workers on a GPU node",
    )
    parser.add_argument("--entrypoint-memory", type=int, help="memory in bytes reserved for the driver")
    parser.add_argument(
        "--runtime-env",
        metavar="YAML",
        help="a runtime env file (pip, env_vars, ...) merged over xmodal's (working_dir is --working-dir)",
    )
    parser.add_argument("--runtime-env-json", metavar="JSON", help="the same, inline")
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the xmodal command to run"
    )


def run(args: argparse.Namespace) -> int:
    from pipelines.jobs.submission import JobOptions, submit_job

    argv = args.argv[1:] if args.argv[:1] == ["--"] else list(args.argv)
    if not argv:
        log.error(
            "nothing to submit: give the xmodal command after `--`, e.g. -- extract images/ --out f.lmdb"
        )
        return 1
    if not args.address and not args.dry_run:
        log.error("--address is required (the Ray dashboard, e.g. http://HEAD:8265)")
        return 1
    try:
        options = JobOptions(
            submission_id=args.submission_id,
            entrypoint_num_cpus=args.entrypoint_num_cpus,
            entrypoint_num_gpus=args.entrypoint_num_gpus,
            entrypoint_memory=args.entrypoint_memory,
            runtime_env=_runtime_env(args),
        )
        return submit_job(
            args.address,
            argv,
            words=command_words(argv),
            working_dir=args.working_dir,
            wait=args.wait,
            include=args.include,
            options=options,
            dry_run=args.dry_run,
        )
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 1


def _runtime_env(args: argparse.Namespace) -> dict:
    """--runtime-env (YAML or JSON file) and --runtime-env-json, the latter's keys winning."""
    import json

    from pipelines.engine import config_io

    env: dict = {}
    if args.runtime_env:
        env.update(config_io.load_yaml(args.runtime_env))
    if args.runtime_env_json:
        try:
            inline = json.loads(args.runtime_env_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--runtime-env-json is not JSON: {exc}") from None
        if not isinstance(inline, dict):
            raise ValueError('--runtime-env-json must be a JSON object, e.g. \'{"pip": ["emoji"]}\'')
        env.update(inline)
    return env


def command_words(argv: list[str]) -> int:
    """How many leading tokens of `argv` name the xmodal command and its subcommand (`vocab build`,
    `finetune vqa`): words of the CLI, never paths, even where a folder of that name exists here."""
    import argparse

    from pipelines.cli import build_parser

    words, parser = 0, build_parser()
    for token in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subparsers and token in subparsers[0].choices:
            parser = subparsers[0].choices[token]
            words += 1
            continue
        # a positional with fixed choices (`finetune vqa`): a word too
        named = [a for a in parser._actions if not a.option_strings and a.choices and token in a.choices]
        words += bool(named)
        break
    return words
