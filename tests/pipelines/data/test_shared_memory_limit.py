"""A batch array larger than the free shared memory is refused in one line, never left to SIGBUS."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.data import shared_memory


def test_batch_larger_than_free_shared_memory_is_refused(monkeypatch):
    monkeypatch.setattr(shared_memory, "_shm_free", lambda: 1000)
    with pytest.raises(ValueError, match=r"exceeds the 1000 bytes free in /dev/shm") as err:
        shared_memory.shared_zeros((256, 4096, 2048), np.dtype(np.float16))
    assert "\n" not in str(err.value)
    small = shared_memory.shared_zeros((10, 10), np.dtype(np.float32))  # 400 bytes fit
    assert small.shape == (10, 10) and not small.any()
