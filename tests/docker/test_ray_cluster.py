"""docker/ray-cluster.yaml: the `ray up` example config for several machines running the image."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"


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
