"""runtime/heap.py: the C allocator's free pages go back to the system."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from runtime.heap import give_back_free_memory


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_freed_heap_pages_are_returned_to_the_system():
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        assert give_back_free_memory() is False  # nothing to call: says so
        return
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # 256 MiB in 64 KiB blocks (below the allocator's mmap threshold: on its heap), each
    # touched, then all freed but the last, which pins the heap's top so that free() alone
    # gives nothing back: the pages stay in the process, as a burst of requests left them.
    blocks = []
    for _ in range(4096):
        block = libc.malloc(64 * 1024)
        ctypes.memset(block, 1, 64 * 1024)
        blocks.append(block)
    for block in blocks[:-1]:
        libc.free(block)
    held = rss_bytes()
    assert give_back_free_memory() is True
    given_back = held - rss_bytes()
    libc.free(blocks[-1])
    assert given_back > 128 * 2**20, f"only {given_back / 2**20:.0f} MiB returned"
