"""Options shared by the config-driven commands (`pretrain`, `finetune`, `extract`): YAML, flags and
`KEY=VALUE` overrides, and how they resolve to a typed config."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def add_run_arguments(
    parser: argparse.ArgumentParser, data_help: str, features_required: bool = True
) -> None:
    """Data, run directory, schedule, resume and Ray Train options; `KEY=VALUE` overrides anywhere."""
    parser.add_argument(
        "--features",
        nargs="+",
        required=features_required,
        default=[],
        metavar="LMDB",
        help="feature stores (shards)" + ("" if features_required else "; or --images DIR"),
    )
    parser.add_argument("--train", nargs="+", required=True, metavar="JSON", help=f"training {data_help}")
    parser.add_argument("--valid", nargs="*", default=[], metavar="JSON", help=f"validation {data_help}")
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument("--config", help="YAML with train.* and task.* keys (a run's config.yaml works)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=int, help="optimizer steps (wins over epochs)")
    length.add_argument("--epochs", type=int, help="passes over the training set (default: train.epochs)")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="global batch over workers and accumulation (default: train.batch_size)",
    )
    parser.add_argument("--lr", type=float, help="peak learning rate (default: train.lr)")
    parser.add_argument(
        "--save-every", type=int, help="steps between checkpoints (one is always written at the end)"
    )
    parser.add_argument("--seed", type=int, help="seed of shuffling, masking, dropout and initialisation")
    parser.add_argument(
        "--skip-missing", action="store_true", help="drop examples whose images are not stored"
    )
    parser.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="drop examples whose stored records fail the value checks (non-finite, out of range), "
        "logging each, instead of stopping",
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint (other hyper-parameters are refused)",
    )
    start.add_argument(
        "--fork",
        metavar="RUN",
        help="start --out as a new run going on from RUN's last checkpoint (weights, optimizer, step) "
        "with the settings given here; its history.jsonl records what changed",
    )
    parser.add_argument("--workers", type=int, help="Ray Train workers (default: train in this process)")
    parser.add_argument(
        "--gpus-per-worker", type=float, help="GPUs per Ray worker (default: 1 when the cluster has GPUs)"
    )
    parser.add_argument(
        "--cpus-per-worker", type=float, help="CPUs per Ray worker (default: train.cpus_per_worker)"
    )
    parser.add_argument(
        "--address",
        help="Ray cluster for --workers: auto, HOST:PORT or ray://HOST:10001 (default: a private local "
        "Ray instance, or RAY_ADDRESS when set)",
    )
    add_overrides_argument(parser, "config overrides, e.g. train.grad_accum=2")


def add_overrides_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """A trailing `KEY=VALUE ...` positional, accepted anywhere on the command line."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=help_text)
    _accept_overrides_anywhere(parser)


def config_default(cls: type, name: str) -> Any:
    """The default of dataclass field `name` (shown in help; the config stays the one place defining it)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def split_overrides(items: list[str], overrides: list[str]) -> tuple[list[str], list[str]]:
    """`nargs` lists swallow later positionals: KEY=VALUE items found in `items` join `overrides`."""
    kept, found = [], list(overrides)
    for item in items:
        (found if _OVERRIDE.match(item) else kept).append(item)
    return kept, found


def resolve_run_config(
    args: argparse.Namespace, cls: type[T], task_flags: dict[str, Any], base: T | None = None
) -> T:
    """defaults (or `base`) < --config (or, on --resume, the run's own settings) < flags < KEY=VALUE."""
    from pipelines.engine import config_io

    features, train, valid, overrides = _split_overrides(args)
    cfg = config_io.load(cls, args.config, base=base)
    own = resumed_settings(args)
    if own is not None:
        cfg = config_io.merge(cfg, own, where=str(Path(args.out)))
    train_flags = {
        "max_steps": args.max_steps,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "save_every": args.save_every,
        "seed": args.seed,
        "workers": args.workers,
        "gpus_per_worker": args.gpus_per_worker,
        "cpus_per_worker": args.cpus_per_worker,
        "ray_address": args.address,
    }
    task = {
        "features": features,
        "train_files": train,
        "valid_files": valid,
        "skip_missing": args.skip_missing or None,
        "skip_bad_records": args.skip_bad_records or None,
    }
    task.update(task_flags)
    data = {
        "task": {k: v for k, v in task.items() if v is not None},
        "train": {k: v for k, v in train_flags.items() if v is not None},
    }
    cfg = config_io.merge(cfg, data, where="command line")
    if args.max_steps is None and args.epochs is not None:
        cfg = config_io.merge(cfg, {"train": {"max_steps": None}})
    return config_io.apply_overrides(cfg, overrides)


def resumed_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """On --resume (or --fork RUN) without --config: the settings of the run's (RUN's) latest start
    (history.jsonl, else config.yaml), so that flags left out keep the run's values."""
    from pipelines.engine.run_history import current_config

    source = getattr(args, "fork", None)
    if args.config is not None or not (args.resume or source):
        return None
    return current_config(Path(source or args.out))


def start_run(args: argparse.Namespace) -> bool:
    """Whether the run resumes: --resume, or --fork RUN, which first makes --out a copy of RUN's last
    checkpoint and files (`run_history.fork`)."""
    from pipelines.engine.run_history import fork

    if getattr(args, "fork", None):
        fork(Path(args.fork), Path(args.out))
        return True
    return bool(args.resume)


def _split_overrides(args: argparse.Namespace) -> tuple[list[str], list[str], list[str], list[str]]:
    """The data lists without the KEY=VALUE items they swallowed, and all overrides."""
    overrides = list(args.overrides)
    features, overrides = split_overrides(args.features, overrides)
    train, overrides = split_overrides(args.train, overrides)
    valid, overrides = split_overrides(args.valid, overrides)
    return features, train, valid, overrides


def _accept_overrides_anywhere(parser: argparse.ArgumentParser) -> None:
    """argparse binds a `*` positional once, so KEY=VALUE items after later options come back unrecognised:
    collect those into `overrides` instead of failing."""
    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extras = parse_known(args, namespace)
        ns.overrides = list(ns.overrides or []) + [a for a in extras if _OVERRIDE.match(a)]
        return ns, [a for a in extras if not _OVERRIDE.match(a)]

    parser.parse_known_args = parse_known_args
