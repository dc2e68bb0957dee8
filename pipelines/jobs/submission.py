"""Run an xmodal command as a Ray Job: upload the code, stream the logs, return the exit status."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.jobs.job_paths import refusals, resolve_job_paths
from pipelines.jobs.upload import plan_upload, write_package

log = logging.getLogger(__name__)

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def entrypoint(argv: list[str]) -> str:
    """The shell command for `xmodal ARGV...` on the cluster.

    `python -m pipelines` is the `xmodal` console script, but it imports the uploaded working dir first
    (the job's cwd), so the code that runs is the code submitted, not an older copy installed there.
    """
    return shlex.join(["python", "-m", "pipelines", *argv])


@dataclass
class JobOptions:
    """What Ray Jobs users pass to `ray job submit`, passed through: the job's id, the driver's resources
    (the driver runs on the head unless it asks for more), and a runtime env merged over xmodal's."""

    submission_id: str | None = None
    entrypoint_num_cpus: float | None = None
    entrypoint_num_gpus: float | None = None
    entrypoint_memory: int | None = None
    runtime_env: Mapping[str, Any] = field(default_factory=dict)


def submit_job(
    address: str,
    argv: list[str],
    working_dir: str | Path = ".",
    wait: bool = True,
    include: Sequence[str] = (),
    options: JobOptions | None = None,
    words: int = 0,
    dry_run: bool = False,
) -> int:
    """Submit `xmodal ARGV...`; with `wait`, stream its logs and return its exit status, else return 0.

    The working dir goes up without secrets, weights and data (`pipelines.jobs.upload`; `include` patterns
    put some back), as a package zipped here from the plan's own list; what goes up is said first. An
    upload over Ray's limit and every path argument the job could not see or would lose
    (`pipelines.jobs.job_paths`) are refused together before anything is sent. `dry_run` prints the plan
    (every file, what stayed home, the command as it will run) and sends nothing. A job that succeeds ends
    with one line saying where its outputs are on the cluster. The first `words` tokens of `argv` are the
    command's words (`vocab build`), never paths."""
    options = options or JobOptions()
    upload = plan_upload(working_dir, include, strict=False)
    paths = resolve_job_paths(argv, upload, words=words, strict=False)
    refused = [*filter(None, [upload.over_limit()]), *paths.refused]
    try:
        env = runtime_env(options.runtime_env)
    except ValueError as exc:
        refused.append(str(exc))
    if refused:
        raise ValueError(refusals(refused))
    if dry_run:
        print(plan_text(upload.listing(), upload.describe(), paths.argv, env))
        return 0
    print(upload.describe(), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="xmodal-submit-") as scratch:
        # a local zip as working_dir: Ray's client uploads it as it is, as gcs://_ray_pkg_<sha1>.zip
        package = write_package(upload, Path(scratch) / "working_dir.zip")
        client, job_id = _submit(address, paths.argv, {"working_dir": str(package), **env}, options)
    shown = shlex.join(paths.argv)
    print(f"submitted Ray Job {job_id} to {address}: xmodal {shown}", file=sys.stderr, flush=True)
    if not wait:
        print(f"follow it with: ray job logs --follow --address {address} {job_id}", file=sys.stderr)
        return 0
    try:
        asyncio.run(_stream_logs(client, job_id))
        status = _wait_terminal(client, job_id)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; the job keeps running. Stop it with: "
            f"ray job stop --address {address} {job_id}",
            file=sys.stderr,
        )
        return 130
    info = client.get_job_info(job_id)
    if status == "SUCCEEDED":
        print(outputs_line(job_id, paths.outputs), flush=True)
        return 0
    code = getattr(info, "driver_exit_code", None)
    print(f"Ray Job {job_id} {status.lower()}: {info.message or ''}".rstrip(), file=sys.stderr)
    return int(code) if code else 1


def _submit(address: str, argv: list[str], env: dict, options: JobOptions):
    """The client and the job's id, once the Jobs API took the package and the job."""
    import requests
    from ray.job_submission import JobSubmissionClient

    from pipelines.jobs.ray_runtime import enable_token_auth_if_available

    enable_token_auth_if_available()
    try:
        client = JobSubmissionClient(address)
        job_id = client.submit_job(
            entrypoint=entrypoint(argv),
            runtime_env=env,
            submission_id=options.submission_id,
            entrypoint_num_cpus=options.entrypoint_num_cpus,
            entrypoint_num_gpus=options.entrypoint_num_gpus,
            entrypoint_memory=options.entrypoint_memory,
        )
    except (RuntimeError, requests.RequestException) as exc:  # refusals: "Request failed with status 500"
        reason = " ".join(str(exc).split())
        raise ConnectionError(f"{address}: the Ray Jobs API did not take the job: {reason}") from None
    return client, job_id


def plan_text(listing: str, summary: str, argv: list[str], env: dict) -> str:
    """`--dry-run`'s output: every file to upload, what stayed home, and the job as it would be sent."""
    return (
        f"{listing}\n{summary}\n"
        f"command (run in the uploaded folder): {entrypoint(argv)}\n"
        f"runtime env (besides the uploaded folder): {json.dumps(env, sort_keys=True)}\n"
        "dry run: nothing was sent"
    )


def outputs_line(job_id: str, outputs: Sequence[str]) -> str:
    """The last line of a job that succeeded: where its outputs are and how to fetch them."""
    if not outputs:
        return f"Ray Job {job_id} succeeded"
    where = ", ".join(outputs)
    return (
        f"Ray Job {job_id} succeeded; outputs on the cluster: {where} (on the head, or the storage every "
        f"node mounts); fetch with: rsync -a HEAD:{outputs[0]} . (or ray rsync-down CLUSTER.yaml "
        f"{outputs[0]} . on a `ray up` cluster)"
    )


def runtime_env(extra: Mapping[str, Any] | None = None) -> dict:
    """The Ray Job's runtime_env but its working dir (the planned package): the user's own `extra` keys
    (pip, env_vars, ...), env_vars merged with ours. Setting the working dir or excludes, or local
    `py_modules` (Ray would zip them by its own walk, past the upload rules), is refused."""
    extra = dict(extra or {})
    taken = sorted({"working_dir", "excludes"} & extra.keys())
    if taken:
        raise ValueError(
            f"the runtime env sets {', '.join(taken)}, which xmodal sets from --working-dir and its upload "
            "rules; use --working-dir and --include instead"
        )
    modules = extra.get("py_modules") or []
    modules = [modules] if isinstance(modules, str | Path) else modules
    local = [str(module) for module in modules if "://" not in str(module)]
    if local:
        raise ValueError(
            f"the runtime env's py_modules names local paths ({', '.join(local)}), which would go up "
            "without xmodal's upload rules; put them in --working-dir, or give URIs"
        )
    env_vars = {"PYTHONUNBUFFERED": "1", **dict(extra.pop("env_vars", None) or {})}
    return {**extra, "env_vars": env_vars}


async def _stream_logs(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def _wait_terminal(client, job_id: str, poll_s: float = 0.5) -> str:
    """The log stream ends when the job does, but the status may lag a moment behind it."""
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        time.sleep(poll_s)
