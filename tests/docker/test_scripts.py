"""docker/entrypoint.sh (the image's entry point) and docker/dirs.sh (`make docker-dirs`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
DIRS = REPO / "docker" / "dirs.sh"
NOBODY = 65534


def _run(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=30, cwd=cwd)


def test_entrypoint_runs_its_arguments_unchanged(tmp_path: Path) -> None:
    result = _run(
        ["sh", str(ENTRYPOINT), "printf", "%s|", "a b", "--out", ""], {"XMODAL_WRITES": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a b|--out||"


def test_entrypoint_refuses_a_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "runs"
    result = _run(["sh", str(ENTRYPOINT), "true"], {"XMODAL_WRITES": f"{tmp_path} {missing}"})
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"xmodal: {missing} is not writable by uid") and "make docker-dirs" in line


def test_entrypoint_refuses_a_folder_owned_by_root_to_another_uid() -> None:
    """What a container running as XMODAL_UID meets on a folder Docker created as root."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and util-linux's setpriv to run the script as another uid")
    # pytest's tmp folders are private to root: this one must be reachable by the other uid
    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        Path(top).chmod(0o755)
        root_owned = Path(top) / "runs"
        root_owned.mkdir(mode=0o755)
        as_nobody = [
            setpriv,
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "sh",
            "-s",
            "echo",
            "ran",
        ]
        script = ENTRYPOINT.read_text()  # on stdin: the checkout may not be readable by that uid
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "XMODAL_WRITES": str(root_owned)}
        result = subprocess.run(as_nobody, input=script, env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 1 and result.stdout == ""
        assert f"{root_owned} is not writable by uid {NOBODY} gid {NOBODY}" in result.stderr
        root_owned.chmod(0o777)
        result = subprocess.run(as_nobody, input=script, env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0 and result.stdout == "ran\n", result.stderr


def test_entrypoint_gives_ray_a_private_home_when_the_images_is_not_its_own() -> None:
    """The image's home is its user's (0700); a Ray node run as another uid gets its own, like `xmodal`."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and util-linux's setpriv to run the script as another uid")
    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        Path(top).chmod(0o755)
        image_home = Path(top) / "home"
        image_home.mkdir(mode=0o700)
        tmpdir = Path(top) / "tmp"
        tmpdir.mkdir(mode=0o1777)
        tmpdir.chmod(0o1777)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(image_home),
            "TMPDIR": str(tmpdir),
        }
        as_nobody = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-s"]
        script = ENTRYPOINT.read_text()
        result = subprocess.run(
            [*as_nobody, "sh", "-c", 'echo "$HOME"; stat -c "%u %a" "$HOME"'],
            input=script, env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.split("\n")[:2] == [f"{tmpdir}/xmodal-home-{NOBODY}", f"{NOBODY} 700"]
        # a folder of that name made by someone else is refused, not used
        (tmpdir / f"xmodal-home-{NOBODY}").rmdir()
        (tmpdir / f"xmodal-home-{NOBODY}").mkdir(mode=0o777)
        (tmpdir / f"xmodal-home-{NOBODY}").chmod(0o777)
        result = subprocess.run(
            [*as_nobody, "echo", "ran"], input=script, env=env, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 1 and result.stdout == ""
        assert f"xmodal-home-{NOBODY} is not a private folder of uid {NOBODY}" in result.stderr


def test_entrypoint_refuses_a_ray_node_without_a_token() -> None:
    result = _run(
        ["sh", str(ENTRYPOINT), "ray", "--version"], {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ""}
    )
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("xmodal: RAY_AUTH_TOKEN is empty: set it in docker/.env")
    # xmodal's own commands start a private Ray that makes its own token: no check there
    result = _run(["sh", str(ENTRYPOINT), "echo", "ok"], {"RAY_AUTH_MODE": "token"})
    assert result.returncode == 0 and result.stdout == "ok\n"


def test_dirs_creates_the_writable_folders_from_the_env_file(tmp_path: Path) -> None:
    env_file = tmp_path / "my.env"
    features = tmp_path / "data" / "feature stores"
    runs = tmp_path / "runs"
    env_file.write_text(
        f'# settings\nFEATURES_DIR="{features}"\nRUNS_DIR = {runs}\nIMAGES_DIR=/nonexistent\n'
    )
    result = _run(["make", "-s", "-C", str(REPO), "docker-dirs", f"DOCKER_ENV={env_file}"], {})
    assert result.returncode == 0, result.stderr
    assert features.is_dir() and runs.is_dir()
    assert f"{features}: ready" in result.stdout and f"{runs}: ready" in result.stdout
    assert not Path("/nonexistent").exists(), "inputs are read-only mounts: never created"


def test_dirs_resolves_relative_paths_from_the_docker_folder(tmp_path: Path) -> None:
    docker = tmp_path / "docker"
    docker.mkdir()
    shutil.copy(DIRS, docker / "dirs.sh")
    (docker / ".env").write_text("FEATURES_DIR=../features\n")  # RUNS_DIR unset: compose's default ../runs
    result = _run(["sh", str(docker / "dirs.sh")], {}, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "features").is_dir() and (tmp_path / "runs").is_dir()


def test_dirs_says_what_is_missing(tmp_path: Path) -> None:
    result = _run(["sh", str(DIRS), str(tmp_path / "absent.env")], {})
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"{tmp_path / 'absent.env'} is missing: cp docker/.env.example docker/.env and edit it"
    )
    env_file = tmp_path / "no-features.env"
    env_file.write_text("RUNS_DIR=/tmp\n")
    result = _run(["sh", str(DIRS), str(env_file)], {})
    assert result.returncode == 1 and result.stderr.strip() == f"set FEATURES_DIR in {env_file}"


def test_entrypoint_appends_the_extra_arguments_split_at_spaces(tmp_path: Path) -> None:
    (tmp_path / "match-me").touch()
    env = {"XMODAL_WRITES": str(tmp_path), "XMODAL_EXTRA_ARGS": "--lr 2e-5  train.grad_accum=2 *"}
    result = _run(["sh", str(ENTRYPOINT), "printf", "%s|", "a b"], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a b|--lr|2e-5|train.grad_accum=2|*|", "split at spaces, never globbed"
    result = _run(["sh", str(ENTRYPOINT), "printf", "%s|", "a"], {**env, "XMODAL_EXTRA_ARGS": ""})
    assert result.stdout == "a|"


def test_entrypoint_refuses_a_missing_needed_file_before_running(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    env = {"XMODAL_WRITES": str(tmp_path), "XMODAL_NEEDS": str(vocab)}
    result = _run(["sh", str(ENTRYPOINT), "echo", "extracting"], env)
    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"xmodal: {vocab} is missing") and "docker/.env" in line
    vocab.write_text("[PAD]\n")
    result = _run(["sh", str(ENTRYPOINT), "echo", "extracting"], env)
    assert result.returncode == 0 and result.stdout == "extracting\n"
