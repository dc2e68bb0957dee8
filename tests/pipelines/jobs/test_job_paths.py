"""Path arguments of a Ray Job: relative outputs and inputs the job could not see are refused before
anything is sent; uploaded inputs are rewritten relative to the job's working dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.jobs.job_paths import resolve_job_paths
from pipelines.jobs.upload import plan_upload


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "run.yaml").write_text("train: {lr: 1.0e-4}\n")
    (root / "data" / "feats.lmdb").mkdir(parents=True)
    (root / "data" / "feats.lmdb" / "data.mdb").write_bytes(b"\0" * 16)
    (root / "data" / "train.json").write_text("[]")
    return root


def test_a_relative_out_is_refused_naming_the_argument(project: Path) -> None:
    upload = plan_upload(project)
    with pytest.raises(ValueError, match=r"^--out runs/x is a relative path: .*Ray deletes.*--out /runs/x$"):
        resolve_job_paths(["finetune", "vqa", "--out", "runs/x"], upload, cwd=project)
    with pytest.raises(ValueError, match=r"^--out runs/x is a relative path"):
        resolve_job_paths(["finetune", "vqa", "--out=runs/x"], upload, cwd=project)


def test_inputs_left_out_of_the_upload_or_outside_it_are_refused(project: Path, tmp_path: Path) -> None:
    upload = plan_upload(project)
    with pytest.raises(
        ValueError, match=r"^--features data/feats.lmdb: data/feats.lmdb/data.mdb is not uploaded"
    ):
        resolve_job_paths(["pretrain", "--features", "data/feats.lmdb"], upload, cwd=project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "train.json").write_text("[]")
    with pytest.raises(
        ValueError, match=r"^--train train.json is .*elsewhere/train.json, outside the uploaded"
    ):
        resolve_job_paths(["pretrain", "--train", "train.json"], upload, cwd=elsewhere)
    with pytest.raises(ValueError, match=r"^task.init \.\./elsewhere is .*outside the uploaded"):
        resolve_job_paths(["finetune", "vqa", "task.init=../elsewhere"], upload, cwd=project)


def test_uploaded_inputs_are_rewritten_for_the_jobs_working_dir(project: Path) -> None:
    upload = plan_upload(project)
    argv = ["pretrain", "--config", "run.yaml", "--train", "../data/train.json", "x-large", "--lr", "-1e-5"]
    argv += ["--features", "/data/f.lmdb", "--out", "/runs/a", "--vocab", "bert-base-uncased", "s3://b/c"]
    argv += ["model.name=unc-nlp/lxmert-base-uncased", "model.dtype=torch.float16"]
    paths = resolve_job_paths(argv, upload, cwd=project / "configs")
    assert paths.argv == [
        "pretrain", "--config", "configs/run.yaml", "--train", "data/train.json", "x-large", "--lr", "-1e-5",
        "--features", "/data/f.lmdb", "--out", "/runs/a", "--vocab", "bert-base-uncased", "s3://b/c",
        "model.name=unc-nlp/lxmert-base-uncased", "model.dtype=torch.float16",
    ]  # fmt: skip
    assert paths.outputs == ["/runs/a"]


def test_submit_from_another_folder_is_refused_before_the_upload(
    project, tmp_path, monkeypatch, caplog, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "feats.lmdb").mkdir()
    # port 9 (discard) is never a Jobs API: reaching it would be another error than the refusal
    argv = ["submit", "--address", "http://127.0.0.1:9", "--working-dir", str(project), "--"]
    assert main([*argv, "pretrain", "--features", "feats.lmdb", "--out", "/runs/x"]) == 1
    assert main([*argv, "pretrain", "--features", "/data/f.lmdb", "--out", "runs/x"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors[0].startswith("--features feats.lmdb is ") and "outside the uploaded folder" in errors[0]
    assert errors[1].startswith("--out runs/x is a relative path")
    assert "uploading" not in capsys.readouterr().err, "refused before the upload"


def test_command_words_are_never_paths_even_where_a_folder_has_their_name(project: Path) -> None:
    """`vocab build` and `finetune vqa` stay words when `build/` or `vqa/` exist here and are not uploaded."""
    for word in ("build", "vqa", "vocab"):
        (project / word).mkdir()
        (project / word / "weights.pkl").write_bytes(b"\0")  # left out of the upload
    upload = plan_upload(project)
    from pipelines.commands.submit import command_words

    argv = ["vocab", "build", "/data/corpus.txt", "--out", "/runs/vocab.txt"]
    assert resolve_job_paths(argv, upload, cwd=project, words=command_words(argv)).argv == argv
    argv = ["finetune", "vqa", "--train", "/data/train.json", "--out", "/runs/v"]
    assert resolve_job_paths(argv, upload, cwd=project, words=command_words(argv)).argv == argv
    argv = ["finetune", "vqa", "--init", "build", "--out", "/runs/v"]
    with pytest.raises(ValueError, match=r"^--init build: build/weights.pkl is not uploaded"):
        resolve_job_paths(argv, upload, cwd=project, words=command_words(argv))


@pytest.mark.parametrize("value", ["missing.json", "images/", "./imgs", "data/typo.json", "data/nope"])
def test_a_relative_input_that_names_nothing_here_is_refused_naming_it(project: Path, value: str) -> None:
    upload = plan_upload(project)
    with pytest.raises(ValueError, match=rf"^--train {value}: no such file or folder here \(") as refused:
        resolve_job_paths(["pretrain", "--train", value, "--out", "/runs/a"], upload, cwd=project)
    assert "\n" not in str(refused.value)


def test_every_refusal_is_listed_at_once(project: Path, tmp_path: Path, monkeypatch, caplog, capsys) -> None:
    (tmp_path / "outside.json").write_text("[]")
    monkeypatch.chdir(project)
    argv = ["submit", "--address", "http://127.0.0.1:9", "--working-dir", str(project), "--", "pretrain"]
    argv += ["--train", "missing.json", "../outside.json", "--features", "data/feats.lmdb", "--out", "runs/x"]
    assert main(argv) == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    lines = error.splitlines()
    assert lines[0] == "4 problems, nothing sent:"
    assert lines[1].startswith("  - --train missing.json: no such file or folder here")
    assert lines[2].startswith("  - argument ../outside.json is ") and "outside the uploaded" in lines[2]
    assert lines[3].startswith("  - --features data/feats.lmdb: data/feats.lmdb/data.mdb is not uploaded")
    assert lines[4].startswith("  - --out runs/x is a relative path")
    assert "uploading" not in capsys.readouterr().err, "refused before the upload"
