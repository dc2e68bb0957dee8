"""What `xmodal submit` uploads, checked offline: secrets, weights and data stay home unless included, the
package holds exactly the planned list, and an upload over the limit is refused before any connection."""

from __future__ import annotations

import os
import time
import zipfile
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.jobs import submission
from pipelines.jobs.upload import plan_upload, write_package

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


def _packed(upload, tmp_path) -> dict[str, bytes]:
    """What the package sent to the Jobs API holds: member name -> contents."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(write_package(upload, tmp_path / "pkg.zip")) as package:
        return {name: package.read(name) for name in package.namelist()}


def test_only_the_code_goes_up_and_the_package_holds_it(tree, tmp_path):
    upload = plan_upload(tree)
    assert set(upload.files) == set(CODE) | {".gitignore"}
    assert upload.total_bytes == 100 * len(CODE) + len(".gitignore: configs/local.yaml") - 11
    secrets = {".env", ".env.production", "deploy/id_ed25519", "certs/server.key", ".ray", "auth_token"}
    assert set(upload.left_out["secret"]) == secrets
    assert set(upload.left_out["weights"]) == set(WEIGHTS)
    assert set(upload.left_out["data"]) == {"feats.lmdb", "data/train.tsv", "images/cat.jpg"}
    packed = _packed(upload, tmp_path)
    assert set(packed) == set(upload.files) and packed["pyproject.toml"] == b"x" * 100
    line = upload.describe()
    assert line.startswith(f"uploading 6 files (0.0 MiB, uncompressed) from {tree}; left out: 6 secret (")
    assert "--include PATTERN" in line and "\n" not in line


def test_include_puts_a_file_back(tree, tmp_path):
    upload = plan_upload(tree, include=["weights/*.safetensors"])
    assert "weights/model.safetensors" in upload.files and ".env" not in upload.files
    assert set(_packed(upload, tmp_path)) == set(upload.files)


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


def test_secrets_come_after_the_included_patterns(tree):
    upload = plan_upload(tree, include=["*.pt"])
    # the last matching pattern wins: no include can put a key back
    assert upload.excludes.index("!*.[pP][tT]") < upload.excludes.index(".[eE][nN][vV]")


def test_a_users_runtime_env_merges_over_ours_but_cannot_move_the_working_dir():
    env = submission.runtime_env({"pip": ["emoji"], "env_vars": {"HF_HOME": "/cache"}})
    assert env["pip"] == ["emoji"] and "working_dir" not in env
    assert env["env_vars"] == {"PYTHONUNBUFFERED": "1", "HF_HOME": "/cache"}
    with pytest.raises(ValueError, match="working_dir, which xmodal sets from --working-dir"):
        submission.runtime_env({"working_dir": "/elsewhere"})
    with pytest.raises(ValueError, match=r"py_modules names local paths \(\.\./lib\)"):
        submission.runtime_env({"py_modules": ["../lib", "s3://bucket/m.zip"]})


def test_include_never_puts_a_key_back(tree, tmp_path):
    upload = plan_upload(tree, include=["*.key", ".env", "id_*"])
    assert not {"certs/server.key", ".env", "deploy/id_ed25519"} & set(upload.files)
    assert not {"certs/server.key", ".env", "deploy/id_ed25519"} & set(_packed(upload, tmp_path))
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
    packed = _packed(upload, tmp_path / "pkg")
    assert set(packed) == wanted and packed["pkg/same_code.py"] == b"print(1)"
    line = upload.describe()
    assert "8 link (" in line and "never go up" in line and "--include" not in line


def test_ray_unpacks_the_package_as_the_working_dir(tree, tmp_path):
    """The cluster unzips a gcs:// working_dir package without removing a top folder: the package's
    members land at the job's working dir, as Ray's own packages do."""
    from ray._private.runtime_env.packaging import get_uri_for_package, unzip_package

    upload = plan_upload(tree)
    package = write_package(upload, tmp_path / "working_dir.zip")
    assert get_uri_for_package(package).startswith("gcs://_ray_pkg_")
    assert write_package(upload, tmp_path / "again.zip").read_bytes() == package.read_bytes()
    unzip_package(str(package), str(tmp_path / "job"), remove_top_level_directory=False, unlink_zip=False)
    found = {p.relative_to(tmp_path / "job").as_posix() for p in (tmp_path / "job").rglob("*") if p.is_file()}
    assert found == set(upload.files)


def test_a_file_hard_linked_from_outside_stays_home(tmp_path):
    """A hard link to a key is the key under another name: a file with more links than names here."""
    home = tmp_path / "home"
    home.mkdir()
    key = home / "id_fake"
    key.write_text("FAKE PRIVATE KEY, made by the test")
    root = tmp_path / "work"
    root.mkdir()
    (root / "code.py").write_text("print(1)")
    os.link(key, root / "hard.txt")
    (root / "twin_a.txt").write_text("both names are inside")
    os.link(root / "twin_a.txt", root / "twin_b.txt")
    (root / "via_link.txt").symlink_to("hard.txt")  # a link inside to the hard link: home too
    upload = plan_upload(root)
    assert set(upload.files) == {"code.py", "twin_a.txt", "twin_b.txt"}
    assert set(upload.left_out["hardlink"]) == {"hard.txt", "via_link.txt"}
    assert "files hard-linked from outside the folder" in upload.describe()
    packed = _packed(upload, tmp_path / "pkg")
    assert set(packed) == set(upload.files)
    assert not any(b"FAKE PRIVATE KEY" in body for body in packed.values())


def test_data_and_archives_stay_home_whatever_their_case(tmp_path):
    root = tmp_path / "work"
    (root / "photos" / "2024").mkdir(parents=True)
    (root / "dist").mkdir()
    (root / "code.py").write_text("print(1)")
    names = ["photos/2024/hubble_deep_field.JPG", "photos/a.Png", "dist/xmodal-0.1-py3-none-any.whl"]
    names += ["dist/src.tar.XZ", "MODEL.PT", "deploy/ID_RSA", "certs/Server.KEY"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"\0")
    upload = plan_upload(root)
    assert set(upload.files) == {"code.py"}
    assert set(upload.left_out["data"]) == {*names[:4]}
    assert upload.left_out["weights"] == ["MODEL.PT"]
    assert set(upload.left_out["secret"]) == {"deploy/ID_RSA", "certs/Server.KEY"}
    # the pattern that puts them back matches any case as well; no include puts a key back
    upload = plan_upload(root, include=["*.jpg", "*.key"])
    assert set(upload.files) == {"code.py", "photos/2024/hubble_deep_field.JPG"}


def test_the_walk_is_bounded(linked):
    with pytest.raises(ValueError, match=r"holds more than 3 files and folders; point it at the code folder"):
        plan_upload(linked, max_entries=3)


def test_a_file_swapped_for_a_link_after_the_plan_is_refused(tmp_path):
    key = tmp_path / "id_fake"
    key.write_text("FAKE PRIVATE KEY, made by the test")
    root = tmp_path / "work"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "code.py").write_text("print(1)")
    upload = plan_upload(root)
    (root / "pkg" / "code.py").unlink()
    (root / "pkg" / "code.py").symlink_to(key)
    with pytest.raises(ValueError, match=r"pkg/code\.py changed after it was listed .*; submit again"):
        write_package(upload, tmp_path / "pkg.zip")
    (root / "pkg" / "code.py").unlink()
    (root / "pkg" / "code.py").write_text("print(1)")
    upload = plan_upload(root)
    (root / "pkg").rename(root / "real")
    (root / "pkg").symlink_to(root / "real")  # the very file planned, but through a link now
    with pytest.raises(ValueError, match=r"changed after it was listed"):
        write_package(upload, tmp_path / "pkg.zip")


def test_a_name_a_package_cannot_hold_is_refused_at_plan_time(tmp_path, caplog, monkeypatch):
    root = tmp_path / "work"
    root.mkdir()
    (root / "code.py").write_text("print(1)")
    (Path(os.fsdecode(bytes(root))) / os.fsdecode(b"bad\xffname.py")).write_text("print(2)")
    with pytest.raises(ValueError, match=r"1 files whose names are not UTF-8.*bad\\xffname\.py.*\.rayignore"):
        plan_upload(root)

    def no_client(*args, **kwargs):
        raise AssertionError("connected before refusing")

    monkeypatch.setattr("ray.job_submission.JobSubmissionClient", no_client)
    for dry in ([], ["--dry-run"]):
        argv = ["submit", "--address", "http://127.0.0.1:1", *dry, "--working-dir", str(root), "--", "--help"]
        assert main(argv) == 1
        assert "bad\\xffname.py" in caplog.records[-1].getMessage()
    (root / ".rayignore").write_text("bad*\n")
    assert set(plan_upload(root).files) == {"code.py", ".rayignore"}


@pytest.mark.parametrize("change", ["grown", "shrunk"])
def test_a_file_whose_size_changed_after_the_plan_is_refused(change, tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    (root / "code.py").write_bytes(b"x" * 1000)
    upload = plan_upload(root, limit=1500)
    with open(root / "code.py", "r+b") as f:  # the same file (inode), another size
        f.truncate(100_000 if change == "grown" else 10)
    with pytest.raises(
        ValueError, match=r"code\.py changed after it was listed \(1,000 bytes planned, .* now\)"
    ):
        write_package(upload, tmp_path / "pkg.zip")
