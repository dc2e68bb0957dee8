"""`xmodal serve` options reach the backend, the server settings and uvicorn; bad ones end in one line."""

from __future__ import annotations

import pytest

import pipelines.apps.serve.backend
from pipelines.cli import main


def test_options_reach_the_backend_the_server_settings_and_uvicorn(monkeypatch):
    loaded, served = {}, {}

    def load_backend(checkpoint, detector, device, vocab, caption_checkpoint, **overrides):
        loaded.update(checkpoint=checkpoint, detector=detector, device=device, vocab=vocab, **overrides)
        loaded.update(caption_checkpoint=caption_checkpoint)
        return object()

    def run(server):
        served.update(app=server.config.app, host=server.config.host, port=server.config.port)
        served.update(deadline=server.config.http.request_seconds, bound=server.config.limit_concurrency)

    monkeypatch.setattr(pipelines.apps.serve.backend, "load_backend", load_backend)
    monkeypatch.setattr("uvicorn.Server.run", run)
    argv = [
        "serve",
        "--checkpoint",
        "runs/vqa/best",
        "--detector",
        "det.pkl",
        "--vocab",
        "vg",
        "--caption-checkpoint",
        "runs/caption/best",
        "--generate-checkpoint",
        "runs/dalle",
        "--port",
        "8123",
    ]
    argv += [
        "--min-size",
        "300",
        "--max-batch",
        "4",
        "--max-wait-ms",
        "2",
        "--max-pending",
        "7",
        "--timeout",
        "9",
        "--beam-size",
        "5",
        "--request-timeout",
        "12",
        "--max-connections",
        "40",
    ]
    assert main(argv) == 0
    assert loaded == {
        "checkpoint": "runs/vqa/best",
        "detector": "det.pkl",
        "device": "auto",  # the backend picks: a GPU if any, else the CPU
        "vocab": "vg",
        "caption_checkpoint": "runs/caption/best",
        "generate_checkpoint": "runs/dalle",
        "min_size": 300,
        "max_size": None,
    }
    assert (served["host"], served["port"]) == ("127.0.0.1", 8123)  # loopback unless asked otherwise
    config = served["app"].state.service.config
    assert (config.max_batch, config.max_wait_ms, config.max_pending, config.timeout_s) == (4, 2.0, 7, 9.0)
    assert config.beam_size == 5
    assert (served["deadline"], served["bound"]) == (12.0, 40)
    served["app"].state.service.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--checkpoint", "{dir}"], "is not a fine-tuned directory"),
        (["--caption-checkpoint", "{dir}"], "is not a fine-tuned directory"),
        ([], "give --checkpoint (a VQA/GQA model or a captioner), --caption-checkpoint or "),
        (["--checkpoint", "{dir}", "--max-batch", "0"], "max_batch must be >= 1, got 0"),
        (["--checkpoint", "{dir}", "--timeout", "0"], "timeout_s must be > 0, got 0.0"),
        (["--checkpoint", "{dir}", "--beam-size", "0"], "beam_size must be >= 1, got 0"),
    ],
)
def test_bad_options_end_in_one_line(tmp_path, capsys, options, message):
    assert main(["serve", *(o.format(dir=tmp_path) for o in options)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("xmodal serve: ") and message in err and "Traceback" not in err
