"""What `xmodal submit` uploads, checked offline: secrets, weights and data stay home unless included, the
list equals what Ray itself packages with the same excludes, and an upload over the limit is refused
before any connection."""

from __future__ import annotations

import os
import time
import zipfile
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.jobs import submission
from pipelines.jobs.upload import plan_upload

CODE = ["pyproject.toml", "pipelines/cli.py", "pipelines/data/text.py", "configs/run.yaml", "tokenizer.py"]
SECRETS = [
    ".env",
    ".env.production",
    "deploy/id_ed25519",
    "certs/server.key",
    ".ray/auth_token",
    "auth_token",
]
WEIGHTS = ["weights/model.safetensors", "ckpt/trainer_state.pt", "faster_rcnn.pkl", "pytorch_model.bin"]
DATA = ["feats.lmdb/data.mdb", "data/train.tsv", "images/cat.jpg"]
CACHES = [".venv/bin/python", ".git/HEAD", "runs/a/metrics.jsonl", "pipelines/__pycache__/cli.pyc"]


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "work"
    for name in CODE + SECRETS + WEIGHTS + DATA + CACHES:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
    (root / ".gitignore").write_text("configs/local.yaml\n")
    (root / "configs" / "local.yaml").write_text("ignored by git")
    return root


def _ray_packs(root, excludes, tmp_path) -> set[str]:
    """The files Ray's own packaging zips from `root` with `excludes` (what the upload sends)."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import _zip_files

    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "pkg.zip"
    _zip_files(str(root), ray_constants.get_runtime_env_default_excludes() + excludes, str(out), True)
    return {n for n in zipfile.ZipFile(out).namelist() if not n.endswith("/")}


def test_only_the_code_goes_up_and_ray_agrees(tree, tmp_path):
    upload = plan_upload(tree)
    assert set(upload.files) == set(CODE) | {".gitignore"}
    assert upload.total_bytes == 100 * len(CODE) + len(".gitignore: configs/local.yaml") - 11
    secrets = {".env", ".env.production", "deploy/id_ed25519", "certs/server.key", ".ray", "auth_token"}
    assert set(upload.left_out["secret"]) == secrets
    assert set(upload.left_out["weights"]) == set(WEIGHTS)
    assert set(upload.left_out["data"]) == {"feats.lmdb", "data/train.tsv", "images/cat.jpg"}
    assert set(upload.files) == _ray_packs(tree, upload.excludes, tmp_path)
    line = upload.describe()
    assert line.startswith(f"uploading 6 files (0.0 MiB, uncompressed) from {tree}; left out: 6 secret (")
    assert "--include PATTERN" in line and "\n" not in line


def test_include_puts_a_file_back(tree, tmp_path):
    upload = plan_upload(tree, include=["weights/*.safetensors"])
    assert "weights/model.safetensors" in upload.files and ".env" not in upload.files
    assert set(upload.files) == _ray_packs(tree, upload.excludes, tmp_path)


def test_over_the_limit_is_refused_before_connecting(tree, monkeypatch, caplog):
    (tree / "big.csv").write_bytes(b"0" * 5000)
    with pytest.raises(ValueError, match=r"over Ray's 0\.0 MiB limit \(largest: big\.csv"):
        plan_upload(tree, limit=4096)

    def no_client(*args, **kwargs):
        raise AssertionError("connected before refusing")

    monkeypatch.setattr("ray.job_submission.JobSubmissionClient", no_client)
    monkeypatch.setattr("ray._private.runtime_env.packaging.GCS_STORAGE_MAX_SIZE", 4096)
    argv = ["submit", "--address", "http://127.0.0.1:1", "--working-dir", str(tree), "--", "--help"]
    assert main(argv) == 1
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "over Ray's" in record.getMessage() and record.exc_info is None


def test_the_runtime_env_carries_the_planned_excludes(tree):
    upload = plan_upload(tree, include=["*.pt"])
    env = submission.runtime_env(upload)
    assert env["working_dir"] == str(tree) and env["excludes"] == upload.excludes
    # secrets come after the re-included patterns: the last matching pattern wins
    assert env["excludes"].index("!*.pt") < env["excludes"].index(".env")


def test_a_users_runtime_env_merges_over_ours_but_cannot_move_the_working_dir(tree):
    upload = plan_upload(tree)
    env = submission.runtime_env(upload, {"pip": ["emoji"], "env_vars": {"HF_HOME": "/cache"}})
    assert env["pip"] == ["emoji"] and env["working_dir"] == str(tree)
    assert env["env_vars"] == {"PYTHONUNBUFFERED": "1", "HF_HOME": "/cache"}
    with pytest.raises(ValueError, match="working_dir, which xmodal sets from --working-dir"):
        submission.runtime_env(upload, {"working_dir": "/elsewhere"})


def test_include_never_puts_a_key_back(tree, tmp_path):
    upload = plan_upload(tree, include=["*.key", ".env", "id_*"])
    assert not {"certs/server.key", ".env", "deploy/id_ed25519"} & set(upload.files)
    assert not {"certs/server.key", ".env", "deploy/id_ed25519"} & _ray_packs(tree, upload.excludes, tmp_path)
    assert "certs/server.key" in upload.left_out["secret"]


@pytest.fixture
def linked(tmp_path):
    """A code folder beside a fake home with an SSH folder, holding links to the key, to ~/.ssh, to its
    parent, to /, to a folder inside itself, and harmless links inside; plus a pipe and names to escape."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    (home / "notes.txt").write_text("outside the folder")
    root = tmp_path / "work"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "code.py").write_text("print(1)")
    (root / "[odd] name *.py").write_text("x = 1")
    (root / "pkg" / ".ssh").mkdir()
    (root / "pkg" / ".ssh" / "config").write_text("Host *")
    links = {
        "deploy_material": home / ".ssh" / "id_ed25519",  # a private key under an innocent name
        "ssh": home / ".ssh",
        "up": Path(".."),
        "everything": Path("/"),
        "pkg/outside.txt": home / "notes.txt",
        "pkg/loop": Path(".."),  # a folder inside the folder: never followed either
        "pkg/same_code.py": Path("code.py"),  # a file inside the folder: uploaded
        "pkg/innocent.txt": Path(".ssh/config"),  # a file the rules leave out, under another name
        "dangling": tmp_path / "gone",
        "trailing ": home / "notes.txt",
    }
    for name, target in links.items():
        (root / name).symlink_to(target)
    os.mkfifo(root / "pipe")
    return root


def test_links_never_leave_the_folder(linked, tmp_path):
    plan_upload(linked / "pkg" / ".ssh")  # import Ray before timing the listing
    started = time.perf_counter()
    upload = plan_upload(linked)
    assert time.perf_counter() - started < 2.0  # a hang guard: following the link to / took 23 s
    wanted = {"pkg/code.py", "pkg/same_code.py", "[odd] name *.py"}
    assert set(upload.files) == wanted
    assert set(upload.left_out["link"]) == {
        "deploy_material",
        "ssh",
        "up",
        "everything",
        "pkg/outside.txt",
        "pkg/loop",
        "dangling",
        "trailing ",
    }
    assert set(upload.left_out["secret"]) == {"pkg/.ssh", "pkg/innocent.txt"}
    assert upload.left_out["special"] == ["pipe"]
    packed = _ray_packs(linked, upload.excludes, tmp_path / "pkg")
    assert packed == wanted
    line = upload.describe()
    assert "8 link (" in line and "never go up" in line and "--include" not in line


def test_ray_hashes_the_same_files(linked):
    """Ray hashes the folder (its own walk, which follows links) before packing it: with the planned
    excludes that walk stays inside too, so it ends at once instead of reading /proc."""
    from ray._private.runtime_env.packaging import get_uri_for_directory

    upload = plan_upload(linked)
    started = time.perf_counter()
    get_uri_for_directory(str(linked), include_gitignore=True, excludes=upload.excludes)
    assert time.perf_counter() - started < 2.0  # a hang guard, as above


def test_the_walk_is_bounded(linked):
    with pytest.raises(ValueError, match=r"holds more than 3 files and folders; point it at the code folder"):
        plan_upload(linked, max_entries=3)
