"""The one start-or-join policy: a private local Ray instance unless an address says otherwise, for
extraction and training alike."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_ray(monkeypatch):
    """`ray.init` calls recorded instead of made; Ray reads as not yet initialised."""
    import ray

    from pipelines.jobs import ray_runtime

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray_runtime, "enable_token_auth_if_available", lambda: False)
    monkeypatch.setattr(ray_runtime, "_current_address", lambda: "10.0.0.1:6379")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(ray_runtime.RAY_JOB_MARKER, raising=False)
    return calls


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", "ray://10.0.0.1:10001"])
def test_joining_a_cluster_uploads_the_packages_unless_from_a_ray_job(fake_ray, monkeypatch, address):
    from pipelines.jobs import ray_runtime

    calls = fake_ray

    def shipped(kw: dict) -> list[str]:
        return [Path(p).name for p in (kw.get("runtime_env") or {}).get("py_modules", [])]

    ray_runtime.init_ray(address)
    (kw,) = calls
    assert kw["address"] == address
    assert shipped(kw) == ["extraction", "storage", "model", "pipelines"]
    assert all((Path(p) / "__init__.py").is_file() for p in kw["runtime_env"]["py_modules"])

    calls.clear()  # a RAY_ADDRESS the user exported joins that cluster, code and all
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    ray_runtime.init_ray(None)
    assert calls[0]["address"] == "10.0.0.1:6379" and shipped(calls[0]) == shipped(kw)

    calls.clear()  # inside a Ray Job (its driver's env as Ray 2.60 sets it): the working dir has the code
    monkeypatch.setenv(ray_runtime.RAY_JOB_MARKER, '{"runtime_env": {}, "metadata": {}}')
    ray_runtime.init_ray(None)
    ray_runtime.init_ray(address)
    assert [c["address"] for c in calls] == ["10.0.0.1:6379", address]
    assert all(c.get("runtime_env") is None for c in calls)

    calls.clear()  # a private local instance runs this machine's code
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.delenv(ray_runtime.RAY_JOB_MARKER)
    ray_runtime.init_ray(None)
    assert calls[0]["address"] == "local" and "runtime_env" not in calls[0]


def test_training_workers_start_a_private_instance_never_a_running_cluster(fake_ray, monkeypatch):
    from pipelines.jobs.ray_runtime import ray_for_workers

    with ray_for_workers(0) as session:  # training in this process needs no Ray
        assert session is None
    assert fake_ray == []
    with ray_for_workers(2) as session:  # a bare ray.init() would join whatever `ray start` left running
        assert session.started_here
    (kw,) = fake_ray
    assert kw["address"] == "local" and kw["dashboard_host"] == "127.0.0.1"
    fake_ray.clear()
    with ray_for_workers(2, "10.0.0.1:6379"):  # --address joins that cluster, as extract does
        pass
    assert fake_ray[0]["address"] == "10.0.0.1:6379"


def test_ray_train_without_a_session_is_refused(tmp_path):
    from pipelines.engine.launch import fit
    from pipelines.engine.trainer import TrainConfig

    with pytest.raises(ValueError, match="no Ray session is open"):
        fit(object(), TrainConfig(workers=2), tmp_path)  # type: ignore[arg-type]
