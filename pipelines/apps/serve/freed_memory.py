"""Giving freed heap memory back to the system after a large decode (glibc only; elsewhere a no-op)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)


def give_back_freed_memory() -> None:
    """glibc keeps large freed blocks in each thread's heap arena: decodes on the server's worker threads
    would then add up in resident memory although they run within the budget one after another."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
