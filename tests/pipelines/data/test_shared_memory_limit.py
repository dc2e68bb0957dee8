"""A batch buffer larger than the memory available is refused in one line, never left to SIGBUS."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.data import shared_memory


def test_batch_larger_than_available_memory_is_refused(monkeypatch):
    monkeypatch.setattr(shared_memory, "_memory_available", lambda: 1000)
    pool = shared_memory.BufferPool()
    with pytest.raises(ValueError, match=r"exceeds the 1000 bytes of memory available") as err:
        pool.take((256, 4096, 2048), np.dtype(np.float16))
    assert "\n" not in str(err.value)
    small = pool.take((10, 10), np.dtype(np.float32))  # 400 bytes fit
    small[:] = 7
    assert small.shape == (10, 10) and (small == 7).all()
