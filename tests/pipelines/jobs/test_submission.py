"""`xmodal submit`: a Ray head started on 127.0.0.1 runs `xmodal extract` as a Ray Job, then is stopped."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipelines.cli import main
from pipelines.jobs.submission import entrypoint

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict:
    """This machine's environment without the Ray settings our own in-process Ray may have exported."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


@pytest.fixture(scope="module")
def ray_head():
    """A private head: own ports, own temp dir (so no other ray.init finds it), own session to stop.

    `ray start --block` in a new session: every process of this head (GCS, raylet, dashboard, workers,
    job drivers) shares that session id, so stopping it means signalling that session and nothing else.
    """
    temp_dir = tempfile.mkdtemp(prefix="xr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    dashboard = free_port()
    cmd = [
        str(VENV_BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address", "127.0.0.1", "--port", str(free_port()),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
        "--num-cpus", "2", "--object-store-memory", str(200 << 20), "--temp-dir", temp_dir,
    ]  # fmt: skip
    log_path = Path(temp_dir) / "head.log"
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            cmd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_jobs_api(address, head, log_path)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=5)
        leftovers = session_processes(head.pid)
        for proc in leftovers:
            proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
        if head.poll() is None:
            head.kill()
            head.wait()
        assert not [p for p in session_processes(head.pid) if p.status() != psutil.STATUS_ZOMBIE]
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_jobs_api(address: str, head: subprocess.Popen, log_path: Path) -> None:
    probe = (
        "import sys; from pipelines.jobs.ray_runtime import enable_token_auth_if_available as e; e(); "
        "from ray.job_submission import JobSubmissionClient as C; C(sys.argv[1]).list_jobs()"
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start exited {head.returncode}:\n{log_path.read_text()[-3000:]}")
        ok = subprocess.run([sys.executable, "-c", probe, address], env=clean_env(), capture_output=True)
        if ok.returncode == 0:
            return
        time.sleep(1)
    pytest.fail(f"the Ray head's Jobs API never answered:\n{log_path.read_text()[-3000:]}")


def test_entrypoint_runs_the_uploaded_xmodal_with_arguments_quoted():
    cmd = entrypoint(["extract", "my images/", "--out", "a b.lmdb"])
    assert shlex.split(cmd) == ["python", "-m", "pipelines", "extract", "my images/", "--out", "a b.lmdb"]


def test_extract_with_a_jobs_address_forwards_every_option_but_the_address():
    from pipelines.cli import build_parser
    from pipelines.commands.extract import cluster_argv

    argv = [
        "extract",
        "a/",
        "l.txt",
        "--out",
        "/s/f.lmdb",
        "--recursive",
        "--no-progress",
        "--id-from",
        "relpath",
        "--weights",
        "w.pkl",
    ]
    argv += ["--selection", "maxnms", "--min-boxes", "10", "--max-boxes", "100", "--min-size", "800"]
    argv += [
        "--workers",
        "3",
        "--cpus-per-worker",
        "0.5",
        "--max-failures",
        "7",
        "--address",
        "http://h:8265",
    ]
    args = build_parser().parse_args(argv)
    forwarded = build_parser().parse_args(cluster_argv(args))
    assert forwarded.address is None
    assert {**vars(forwarded), "address": args.address} == vars(args)


def test_submit_without_command_or_reachable_cluster_is_a_clear_error(caplog):
    assert main(["submit", "--address", "http://127.0.0.1:9", "--"]) == 1
    assert "nothing to submit" in caplog.text
    assert (
        main(
            [
                "submit",
                "--address",
                f"http://127.0.0.1:{free_port()}",
                "--",
                "extract",
                "/data/x",
                "--out",
                "/data/y",
            ]
        )
        == 1
    )
    assert "127.0.0.1" in caplog.text


def test_a_jobs_api_that_refuses_the_job_is_one_line_naming_the_address(caplog, capsys):
    class Refusing(http.server.BaseHTTPRequestHandler):
        def _refuse(self):
            body = b"No available agent to submit job, please try again later."
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # the version check passes (a Ray 2 dashboard); the job itself is refused
            if self.path != "/api/version":
                return self._refuse()
            body = json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_PUT = _refuse

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["submit", "--address", address, "--", "extract", "/data/x", "--out", "/data/y"]) == 1
    finally:
        server.shutdown()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith(f"{address}: ") and "\n" not in errors[0], errors
    assert "did not take the job" in errors[0] and "No available agent to submit job" in errors[0]
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_submit_runs_extract_on_the_head_streams_logs_and_returns_its_exit_status(
    ray_head, tmp_path, repo_root
):
    import numpy as np
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 90, 3), dtype=np.uint8)).save(
        images / "img_000.png"
    )
    (images / "empty.jpg").write_bytes(b"")
    out = tmp_path / "job.lmdb"
    argv = ["extract", str(images), "--out", str(out), "--min-size", "64", "--max-size", "64"]
    argv += ["--min-boxes", "4", "--max-boxes", "4"]
    # a fresh environment without RAY_AUTH_MODE: the token of this machine must be picked up by itself
    submit = [
        str(VENV_BIN / "xmodal"),
        "submit",
        "--address",
        ray_head,
        "--working-dir",
        str(repo_root),
        "--",
    ]
    proc = subprocess.run([*submit, *argv], env=clean_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 2, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )  # one broken image, --max-failures 0
    assert "submitted Ray Job" in proc.stderr
    assert '"failed": 1' in proc.stdout and "empty.jpg" in proc.stdout  # the job's own output, streamed

    from storage import FeatureReader

    reader = FeatureReader(out)
    assert list(reader.keys()) == ["img_000"] and reader["img_000"].num_boxes == 4
    reader.close()


@pytest.mark.slow
def test_a_job_ends_with_where_its_outputs_are_and_they_are_there(ray_head, tmp_path, repo_root):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a red circle left of a blue square\nthe green triangle is small\n" * 20)
    out = tmp_path / "job" / "vocab.txt"
    submit = [str(VENV_BIN / "xmodal"), "submit", "--address", ray_head, "--working-dir", str(repo_root)]
    submit += ["--submission-id", f"xmodal-vocab-{os.getpid()}", "--entrypoint-num-cpus", "0.5"]
    submit += ["--runtime-env-json", '{"env_vars": {"XMODAL_TEST_MARK": "1"}}']
    argv = ["vocab", "build", str(corpus), "--out", str(out), "--vocab-size", "60"]
    proc = subprocess.run(
        [*submit, "--", *argv], env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"submitted Ray Job xmodal-vocab-{os.getpid()}" in proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"Ray Job xmodal-vocab-{os.getpid()} succeeded; outputs on the cluster: {out} ")
    assert out.read_text().split()[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_extract_detector_overrides_are_checked_before_any_work(tmp_path, caplog):
    from pipelines.cli import main

    out = tmp_path / "feats.lmdb"
    code = main(["extract", str(tmp_path), "--out", str(out), "--set", "no_such_setting=3"])
    assert code == 1
    assert "no_such_setting" in caplog.text
    assert not out.exists()
    assert main(["extract", str(tmp_path), "--out", str(out), "--set", "post_nms_topk"]) == 1


def test_extract_overrides_travel_to_the_cluster_command():
    from pipelines.cli import build_parser
    from pipelines.commands.extract import _parse_overrides, cluster_argv

    args = build_parser().parse_args(
        ["extract", "imgs", "--out", "f.lmdb", "--set", "post_nms_topk=20", "--set", "nms_thresh=0.3"]
    )
    argv = cluster_argv(args)
    assert argv[argv.index("--set") :][:4] == ["--set", "post_nms_topk=20", "--set", "nms_thresh=0.3"]
    assert _parse_overrides(args.detector_overrides) == {"post_nms_topk": 20, "nms_thresh": 0.3}
    assert build_parser().parse_args(argv).detector_overrides == args.detector_overrides


@pytest.mark.parametrize(("flags", "progress"), [([], True), (["--no-progress"], False)])
def test_extract_no_progress_turns_the_bar_off(flags, progress, tmp_path, monkeypatch):
    from pipelines.jobs.extract import driver as extract

    seen = []

    def stop(cfg):
        seen.append(cfg)
        raise extract.JobError("stopped by the test")

    monkeypatch.setattr(extract, "run_extract", stop)
    assert main(["extract", str(tmp_path), "--out", str(tmp_path / "f.lmdb"), *flags]) == 1
    assert [cfg.progress for cfg in seen] == [progress]


class StandInJobsAPI(http.server.ThreadingHTTPServer):
    """A Ray Jobs API on 127.0.0.1 that keeps what it is sent: packages by name, jobs as JSON."""

    def __init__(self):
        self.packages: dict[str, bytes] = {}
        self.jobs: list[dict] = []
        self.requests: list[str] = []
        super().__init__(("127.0.0.1", 0), _StandInHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=5)


class _StandInHandler(http.server.BaseHTTPRequestHandler):
    def _reply(self, code: int, body: dict | None = None):
        data = json.dumps(body or {}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self):
        self.server.requests.append(f"GET {self.path}")
        if self.path == "/api/version":
            return self._reply(200, {"version": "4", "ray_version": "2.60.0", "ray_commit": "x"})
        name = self.path.rsplit("/", 1)[-1]
        self._reply(200 if name in self.server.packages else 404)

    def do_PUT(self):
        self.server.requests.append(f"PUT {self.path}")
        self.server.packages[self.path.rsplit("/", 1)[-1]] = self._body()
        self._reply(200)

    def do_POST(self):
        self.server.requests.append(f"POST {self.path}")
        self.server.jobs.append(json.loads(self._body()))
        self._reply(200, {"job_id": "raysubmit_standin", "submission_id": "raysubmit_standin"})

    def log_message(self, *args):
        pass


@pytest.fixture
def no_ray_token(tmp_path, monkeypatch):
    """A home without a Ray token: the stand-in server must never see this machine's."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def hostile_folder(tmp_path):
    """A code folder holding links whose names end in TAB or CR, to a fake key and a fake /etc outside."""
    outside = tmp_path / "outside"
    (outside / "ssh").mkdir(parents=True)
    (outside / "ssh" / "id_fake").write_text("FAKE PRIVATE KEY, made by the test")
    (outside / "etc").mkdir()
    (outside / "etc" / "passwd").write_text("FAKE ETC FILE")
    root = tmp_path / "work"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "code.py").write_text("print('the code')")
    (root / "key\t").symlink_to(outside / "ssh" / "id_fake")
    (root / "etc\r").symlink_to(outside / "etc")
    (root / "pkg" / "notes\t\r").symlink_to(outside / "ssh" / "id_fake")
    (root / "ssh ").symlink_to(outside / "ssh")
    return root


def test_the_jobs_api_receives_exactly_the_planned_files_never_a_link_target(
    hostile_folder, no_ray_token, capsys
):
    import hashlib
    import io
    import zipfile

    argv = ["submit", "--no-wait", "--working-dir", str(hostile_folder)]
    job = ["--", "vocab", "build", "/data/corpus.txt", "--out", "/runs/vocab.txt"]
    with StandInJobsAPI() as api:
        assert main([*argv, "--address", api.address, *job]) == 0
    plan = capsys.readouterr().err
    assert "uploading 1 files" in plan and "left out: 4 link (" in plan
    ((name, package),) = api.packages.items()
    with zipfile.ZipFile(io.BytesIO(package)) as received:
        contents = {member: received.read(member) for member in received.namelist()}
    assert not [member for member, body in contents.items() if b"FAKE" in body], "a link target went up"
    assert contents == {"pkg/code.py": b"print('the code')"}
    # the package Ray's client sent is the zip written from the plan, named by its own hash
    assert name == f"_ray_pkg_{hashlib.sha1(package).hexdigest()}.zip"
    ((sent,),) = [api.jobs]
    assert sent["runtime_env"]["working_dir"] == f"gcs://{name}"
    assert shlex.split(sent["entrypoint"]) == ["python", "-m", "pipelines", *job[1:]]


def test_dry_run_prints_every_file_and_the_command_and_sends_nothing(
    hostile_folder, no_ray_token, monkeypatch, capsys
):
    (hostile_folder / "configs").mkdir()
    (hostile_folder / "configs" / "run.yaml").write_text("train: {lr: 1.0e-4}\n")
    (hostile_folder / "photo.JPG").write_bytes(b"\0")
    monkeypatch.chdir(hostile_folder / "configs")
    job = ["pretrain", "--config", "run.yaml", "--train", "/data/t.json", "--out", "/runs/p"]
    with StandInJobsAPI() as api:
        argv = ["submit", "--dry-run", "--address", api.address, "--working-dir", str(hostile_folder)]
        assert main([*argv, "--", *job]) == 0
        assert main(["submit", "--dry-run", "--working-dir", str(hostile_folder), "--", *job]) == 0
    assert api.requests == []
    out = capsys.readouterr().out.split("dry run: nothing was sent\n")[0]
    lines = out.splitlines()
    assert [line.split()[-1] for line in lines[:2]] == ["configs/run.yaml", "pkg/code.py"]
    assert any(line.split() == ["left", "out", "photo.JPG", "(data)"] for line in lines)
    assert any("key\t" in line and line.endswith("(link)") for line in lines)
    assert (
        "command (run in the uploaded folder): python -m pipelines pretrain --config configs/run.yaml "
        "--train /data/t.json --out /runs/p"
    ) in lines
