"""Run an xmodal command as a Ray Job: upload the code, stream the logs, return the exit status."""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipelines.jobs.upload import Upload, plan_upload

log = logging.getLogger(__name__)

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def entrypoint(argv: list[str]) -> str:
    """The shell command for `xmodal ARGV...` on the cluster.

    `python -m pipelines` is the `xmodal` console script, but it imports the uploaded working dir first
    (the job's cwd), so the code that runs is the code submitted, not an older copy installed there.
    """
    return shlex.join(["python", "-m", "pipelines", *argv])


def submit_job(
    address: str,
    argv: list[str],
    working_dir: str | Path = ".",
    wait: bool = True,
    include: Sequence[str] = (),
) -> int:
    """Submit `xmodal ARGV...`; with `wait`, stream its logs and return its exit status, else return 0.

    The working dir goes up without secrets, weights and data (`pipelines.jobs.upload`; `include` patterns
    put some back); what goes up is said first, and an upload over Ray's limit is refused before sending."""
    import requests
    from ray.job_submission import JobSubmissionClient

    from pipelines.jobs.ray_runtime import enable_token_auth_if_available

    upload = plan_upload(working_dir, include)
    print(upload.describe(), file=sys.stderr, flush=True)
    enable_token_auth_if_available()
    try:
        client = JobSubmissionClient(address)
        job_id = client.submit_job(entrypoint=entrypoint(argv), runtime_env=runtime_env(upload))
    except (RuntimeError, requests.RequestException) as exc:  # refusals: "Request failed with status 500"
        reason = " ".join(str(exc).split())
        raise ConnectionError(f"{address}: the Ray Jobs API did not take the job: {reason}") from None
    print(f"submitted Ray Job {job_id} to {address}: xmodal {shlex.join(argv)}", file=sys.stderr, flush=True)
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
        return 0
    code = getattr(info, "driver_exit_code", None)
    print(f"Ray Job {job_id} {status.lower()}: {info.message or ''}".rstrip(), file=sys.stderr)
    return int(code) if code else 1


def runtime_env(upload: Upload) -> dict:
    """The Ray Job's runtime_env: the planned working dir, with the excludes the plan was made with."""
    return {
        "working_dir": str(upload.root),
        "excludes": list(upload.excludes),
        "env_vars": {"PYTHONUNBUFFERED": "1"},
    }


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
