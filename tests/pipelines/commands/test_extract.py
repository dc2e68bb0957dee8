"""`xmodal extract --config YAML KEY=VALUE`: ExtractConfig defaults < YAML < flags < overrides."""

from __future__ import annotations

import pytest
import yaml

from pipelines.cli import build_parser, main
from pipelines.commands.extract import cluster_argv, resolve_extract_config
from pipelines.jobs.extract.config import ExtractConfig, ExtractSummary


def _resolve(argv: list[str]) -> ExtractConfig:
    return resolve_extract_config(build_parser().parse_args(["extract", *argv]))


def test_flags_and_options_default_to_the_config(tmp_path):
    cfg = _resolve(["imgs/", "--out", "f.lmdb"])
    assert cfg == ExtractConfig(inputs=["imgs/"], out="f.lmdb")


def test_yaml_then_flags_then_key_value(tmp_path):
    path = tmp_path / "extract.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "inputs": ["a/", "b/"],
                "out": "yaml.lmdb",
                "batch_size": 8,
                "max_boxes": 50,
                "overrides": {"nms_thresh": 0.4},
            }
        )
    )
    cfg = _resolve(["--config", str(path)])
    assert (cfg.inputs, cfg.out, cfg.batch_size, cfg.max_boxes) == (["a/", "b/"], "yaml.lmdb", 8, 50)
    assert cfg.overrides == {"nms_thresh": 0.4} and cfg.preset == ExtractConfig().preset
    cfg = _resolve(
        ["c/", "--config", str(path), "--batch-size", "2", "max_failures=5", "--set", "post_nms_topk=20"]
        + ["--min-size", "400", "batch_size=3", "overrides.nms_thresh=0.5"]
    )
    assert cfg.inputs == ["c/"]  # the command line's inputs replace the file's
    assert cfg.batch_size == 3 and cfg.max_failures == 5 and cfg.out == "yaml.lmdb"
    assert cfg.overrides == {"nms_thresh": 0.5, "post_nms_topk": 20, "min_size": 400}
    cfg = _resolve(["c/", "--out", "x.lmdb", "--store-class-probs"])
    assert cfg.overrides == {"class_probs": True}


def test_config_and_overrides_travel_to_the_cluster_command(tmp_path):
    argv = ["imgs", "--out", "f.lmdb", "--config", "c.yaml", "batch_size=3", "--store-class-probs"]
    args = build_parser().parse_args(["extract", *argv])
    forwarded = build_parser().parse_args(cluster_argv(args))
    assert vars(forwarded) == vars(args)


def test_grid_flags_reach_the_config_and_the_cluster_command():
    argv = ["imgs", "--out", "g.lmdb", "--features", "grid", "--grid", "native/2"]
    cfg = _resolve(argv)
    assert (cfg.features, cfg.grid) == ("grid", "native/2")
    assert _resolve(["imgs", "--out", "g.lmdb", "--features", "grid"]).grid == "14x14"
    args = build_parser().parse_args(["extract", *argv])
    assert vars(build_parser().parse_args(cluster_argv(args))) == vars(args)
    strided = ["imgs", "--out", "g.lmdb", "--features", "grid", "--grid", "native/1@32"]
    assert _resolve(strided).grid == "native/1@32"
    args = build_parser().parse_args(["extract", *strided])
    assert vars(build_parser().parse_args(cluster_argv(args))) == vars(args)


def test_a_bad_grid_is_one_line_before_any_work(caplog):
    assert main(["extract", "a/", "--out", "f.lmdb", "--features", "grid", "--grid", "fourteen"]) == 1
    assert "--grid 'fourteen' is neither ROWSxCOLS (e.g. 14x14) nor native/K" in caplog.text
    assert main(["extract", "a/", "--out", "f.lmdb", "features=grids"]) == 1
    assert "--features 'grids' is not one of regions, grid" in caplog.text


def test_forward_and_workers_auto_reach_the_config_the_detector_and_the_cluster_command(tmp_path, caplog):
    from pipelines.jobs.extract.config import build_kwargs

    argv = ["imgs", "--out", "f.lmdb", "--forward", "batched", "--workers", "auto", "--batch-size", "6"]
    cfg = _resolve(argv)
    assert (cfg.forward, cfg.workers) == ("batched", None)
    assert _resolve(["imgs", "--out", "f.lmdb", "--workers", "3"]).workers == 3
    assert _resolve(["imgs", "--out", "f.lmdb"]).forward == "auto"
    kwargs = build_kwargs(cfg, "cpu")
    # the job's batch size is how many images travel together; the network's call shape is the detector's
    assert kwargs["forward"] == "batched" and "forward_batch" not in kwargs
    args = build_parser().parse_args(["extract", *argv])
    assert vars(build_parser().parse_args(cluster_argv(args))) == vars(args)
    path = tmp_path / "extract.yaml"
    path.write_text("inputs: [a/]\nout: f.lmdb\nforward: per-image\n")
    assert _resolve(["--config", str(path)]).forward == "per-image"
    assert main(["extract", "a/", "--out", "f.lmdb", "forward=fast"]) == 1
    assert "--forward 'fast' is not one of per-image, batched, auto" in caplog.text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "a/", "--out", "f.lmdb", "--workers", "many"])


def test_bad_config_key_or_value_is_bad_input(tmp_path, caplog):
    path = tmp_path / "extract.yaml"
    path.write_text("inputs: [a/]\nout: f.lmdb\nbatch_sise: 3\n")
    assert main(["extract", "--config", str(path)]) == 1
    assert "batch_sise" in caplog.text
    assert main(["extract", "a/", "--out", "f.lmdb", "batch_size=many"]) == 1
    assert main(["extract", "--out", "f.lmdb"]) == 1  # no inputs anywhere
    assert "give the image folders" in caplog.text


@pytest.mark.parametrize(("failed", "code"), [(0, 0), (3, 2)])
def test_failed_images_beyond_max_failures_exit_2(failed, code, tmp_path, monkeypatch):
    from pipelines.jobs.extract import driver

    seen = []

    def fake_run(cfg: ExtractConfig) -> ExtractSummary:
        seen.append(cfg)
        return ExtractSummary(
            store=cfg.out,
            errors="e.jsonl",
            total=10,
            done=10 - failed,
            skipped=0,
            failed=failed,
            images_per_s=1.0,
            elapsed_s=1.0,
            startup_s=0.1,
            replicas=1,
            restarts=0,
            device="cpu",
            exit_code=2 if failed > cfg.max_failures else 0,
        )

    monkeypatch.setattr(driver, "run_extract", fake_run)
    path = tmp_path / "extract.yaml"
    path.write_text(yaml.safe_dump({"inputs": [str(tmp_path)], "out": str(tmp_path / "f.lmdb")}))
    assert main(["extract", "--config", str(path), "--no-progress"]) == code
    assert seen[0].progress is False and seen[0].inputs == [str(tmp_path)]


def test_ctrl_c_is_one_line_saying_how_to_resume(tmp_path, monkeypatch, caplog, capsys):
    from pipelines.cli import EXIT_INTERRUPTED
    from pipelines.jobs.extract import driver

    def interrupted(cfg: ExtractConfig) -> ExtractSummary:
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "run_extract", interrupted)
    out = tmp_path / "f.lmdb"
    assert main(["extract", str(tmp_path), "--out", str(out), "--no-progress"]) == EXIT_INTERRUPTED == 130
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        f"stopped; the images extracted so far are kept in {out}: rerun the same command to resume"
    ]
    assert "Traceback" not in capsys.readouterr().err
