"""Fixtures for the pipeline tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine threads thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def ray_two_cpus():
    """A private local Ray instance with 2 CPUs for Ray Train tests, shut down afterwards."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
