"""The path arguments of a command sent as a Ray Job. The job runs on the head in a temporary copy of the
uploaded working dir, which Ray deletes: every relative path is checked against the upload before
anything is sent, and refused, naming the argument, when the job could not see it or would lose it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.jobs.upload import Upload

# Options whose value the command writes: a relative one would land in the job's temporary folder.
OUTPUT_OPTIONS = ("--out",)
_OVERRIDE = re.compile(r"^(?P<key>[A-Za-z_][\w.]*)=(?P<value>.*)$")
_NUMBER = re.compile(r"^-?\d+(\.\d*)?([eE][-+]?\d+)?$")
# suffixes of the files commands read: a value ending so is a path, never a word or a hub id
_SUFFIX = re.compile(
    r"\.(json|jsonl|yaml|yml|txt|tsv|csv|lmdb|mdb|h5|hdf5|pt|pth|bin|safetensors|pkl|ckpt|npy|npz|jpe?g|"
    r"png|parquet|zip|tar|gz|py|toml)$",
    re.IGNORECASE,
)


@dataclass
class JobPaths:
    """`argv` with relative inputs written relative to the uploaded folder (the job's working dir), the
    outputs the job writes, as paths on the cluster, and why path arguments are refused, one line each."""

    argv: list[str]
    outputs: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def resolve_job_paths(
    argv: list[str], upload: Upload, cwd: str | Path | None = None, words: int = 0, strict: bool = True
) -> JobPaths:
    """Check and rewrite the path arguments of `argv` for a job whose working dir is `upload`.

    Absolute paths and URIs are the cluster's and pass as given. A relative `--out` is refused. A
    relative input that exists here must be inside the upload, and every file of it uploaded; it is then
    rewritten relative to the upload's root. A relative value that looks like a path (`./x`, `x/`, a file
    suffix, or under a folder that exists here) but names nothing here is refused; any other (a task
    name, a hub id) passes unchanged. The first `words` tokens (the command and subcommand) are words,
    never paths. Every refusal is one line naming the argument and what to do: all of them in one
    ValueError when `strict`, else in `refused`."""
    cwd = Path(cwd or os.getcwd())
    paths = JobPaths(list(argv[:words]))
    previous = None
    for token in argv[words:]:
        option = previous
        if token.startswith("--") and "=" in token:
            option, value = token.split("=", 1)
            paths.argv.append(f"{option}={_checked(option, value, upload, cwd, paths)}")
        elif token.startswith("-") and not _NUMBER.match(token):
            paths.argv.append(token)
        elif match := _OVERRIDE.match(token):
            key = match["key"]
            paths.argv.append(f"{key}={_checked(key, match['value'], upload, cwd, paths)}")
        else:
            named = option if option and option.startswith("-") else "argument"
            paths.argv.append(_checked(named, token, upload, cwd, paths))
        previous = token
    if strict and paths.refused:
        raise ValueError(refusals(paths.refused))
    return paths


def refusals(lines: list[str]) -> str:
    """One refusal as it is; several as a count and one line each, so that all are fixed in one go."""
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} problems, nothing sent:\n" + "\n".join(f"  - {line}" for line in lines)


def _checked(name: str, value: str, upload: Upload, cwd: Path, paths: JobPaths) -> str:
    try:
        return _check(name, value, upload, cwd, paths)
    except ValueError as exc:
        paths.refused.append(str(exc))
        return value


def _check(name: str, value: str, upload: Upload, cwd: Path, paths: JobPaths) -> str:
    if name in OUTPUT_OPTIONS:
        if not _is_cluster_path(value):
            raise ValueError(
                f"{name} {value} is a relative path: the job runs in a temporary copy of {upload.root} on "
                f"the head, which Ray deletes after the job; give a path on the cluster's storage, e.g. "
                f"{name} /runs/{Path(value).name}"
            )
        paths.outputs.append(value)
        return value
    if not value or _is_cluster_path(value):
        return value
    local = (cwd / value).resolve()
    if not local.exists():
        if _looks_like_path(value, cwd):
            raise ValueError(
                f"{name} {value}: no such file or folder here ({local}); fix the path, or give its path on "
                "the cluster (absolute)"
            )
        return value
    if not local.is_relative_to(upload.root):
        raise ValueError(
            f"{name} {value} is {local}, outside the uploaded folder {upload.root}: the job cannot see it; "
            "give its path on the cluster (absolute), or submit from a --working-dir that holds it"
        )
    relative = local.relative_to(upload.root).as_posix()
    missing = _not_uploaded(local, relative, upload)
    if missing is not None:
        raise ValueError(
            f"{name} {value}: {missing} is not uploaded (weights, data and secrets stay home); give its path "
            "on the cluster (absolute), or upload it with --include PATTERN"
        )
    return relative


def _not_uploaded(local: Path, relative: str, upload: Upload) -> str | None:
    """The first file of `local` the upload leaves out, or None."""
    if local.is_file():
        return None if relative in upload.files else relative
    for folder, _, names in os.walk(local):
        for name in sorted(names):
            path = (Path(folder) / name).relative_to(upload.root).as_posix()
            if path not in upload.files:
                return path
    return None


def _looks_like_path(value: str, cwd: Path) -> bool:
    """Whether a relative `value` that names nothing here was meant as a file or folder."""
    if any(char.isspace() for char in value) or _NUMBER.match(value):
        return False
    if value.startswith(("./", "../")) or value.endswith("/") or _SUFFIX.search(value):
        return True
    first = value.split("/", 1)[0]
    return "/" in value and bool(first) and (cwd / first).is_dir()


def _is_cluster_path(value: str) -> bool:
    return value.startswith("/") or "://" in value
