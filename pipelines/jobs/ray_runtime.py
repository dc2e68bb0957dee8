"""Start or join Ray for every xmodal job (extraction and training): a private local instance by default, a
cluster only on request (`--address`, or RAY_ADDRESS as a Ray Job sets it)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DASHBOARD_HOST = "127.0.0.1"
# what a job's Ray workers import; uploaded when this driver joins a cluster, unless from a Ray Job
SHIPPED_PACKAGES = ("extraction", "storage", "model", "pipelines")
# Set by Ray (2.60: JobSupervisor._get_driver_env_vars) in a Ray Job's driver only, which it also gives
# RAY_ADDRESS; RAY_JOB_ID is stripped from the driver's environment, and users export RAY_ADDRESS too.
RAY_JOB_MARKER = "RAY_JOB_CONFIG_JSON_ENV_VAR"


@dataclass
class RaySession:
    """The Ray connection a job runs on; `close()` shuts Ray down only if this session started it."""

    address: str
    started_here: bool

    def close(self) -> None:
        import ray

        if self.started_here and ray.is_initialized():
            ray.shutdown()


def local_cpu_count() -> int:
    """The CPUs this process may run on (cgroup/affinity aware where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def in_ray_job() -> bool:
    """True in the driver of a Ray Job, whose working dir (uploaded at submission) holds the code."""
    return RAY_JOB_MARKER in os.environ


def is_job_api_address(address: str | None) -> bool:
    """True for a dashboard (Ray Jobs API) address such as http://HEAD:8265."""
    return bool(address) and address.startswith(("http://", "https://"))


def enable_token_auth_if_available() -> bool:
    """Send the local Ray token to clusters when one exists and RAY_AUTH_MODE is unset.

    Ray >= 2.60 turns token auth on for clusters started on a machine holding ~/.ray/auth_token, while
    its clients only send the token with RAY_AUTH_MODE=token; Ray's own CLI bridges that gap the same way.
    Returns whether token auth is on for this process.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # Ray before token auth
        return False
    return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    include_dashboard: bool = True,
    object_store_memory: int | None = None,
) -> RaySession:
    """Connect this driver to Ray and say how.

    - Ray already initialised in this process (tests, notebooks): reuse it, never shut it down.
    - `address=None`: join the cluster at RAY_ADDRESS when it is set (by Ray in a Ray Job, or by the
      user); otherwise start a private local instance with `num_cpus` (default: the CPUs this process
      may use) and the dashboard bound to 127.0.0.1. A bare `ray.init()` would silently join whatever
      `ray start` left running.
    - `"auto"`, `"HOST:PORT"` or `"ray://HOST:10001"`: join that cluster.
    - Joining a cluster uploads xmodal's packages for its workers (`shipped_code`), except from inside a
      Ray Job (`in_ray_job`), whose working dir already holds them; the nodes must already have the
      dependencies (torch, ...).
    - `"http://HEAD:8265"` is the Jobs API, not a driver address: use `xmodal submit` for it.
    """
    import ray

    if ray.is_initialized():
        return RaySession(address=_current_address(), started_here=False)
    if is_job_api_address(address):
        raise ValueError(
            f"{address} is a Ray Jobs (dashboard) address; run the command there with "
            f"`xmodal submit --address {address} -- <command>`"
        )
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address is None:
        ray.init(
            address="local",
            num_cpus=num_cpus or local_cpu_count(),
            include_dashboard=include_dashboard,
            dashboard_host=DASHBOARD_HOST,
            object_store_memory=object_store_memory,
            logging_level=logging.WARNING,
        )
        log.info("started a local Ray instance (dashboard on %s only)", DASHBOARD_HOST)
    else:
        if address != "auto":
            enable_token_auth_if_available()
        runtime_env = None if in_ray_job() else shipped_code()
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
        log.info("joined the Ray cluster at %s", address)
    return RaySession(address=_current_address(), started_here=True)


@contextlib.contextmanager
def ray_for_workers(workers: int, address: str | None = None) -> Iterator[RaySession | None]:
    """A Ray session for the duration of a training run with `workers` Ray Train workers (none for 0),
    opened with `init_ray`'s policy and closed afterwards when this run started it."""
    if workers <= 0:
        yield None
        return
    session = init_ray(address)
    try:
        yield session
    finally:
        session.close()


def shipped_code() -> dict:
    """A runtime_env uploading xmodal's packages, so that workers on other machines can import them."""
    dirs = []
    for name in SHIPPED_PACKAGES:
        spec = importlib.util.find_spec(name)  # found without importing (torch would come with it)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"package {name!r} is not importable here; install xmodal (pip install -e .)")
        dirs.append(str(Path(next(iter(spec.submodule_search_locations))).resolve()))
    return {"py_modules": dirs}


def _current_address() -> str:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # Ray Client sessions have no GCS address
        return "ray-client"
