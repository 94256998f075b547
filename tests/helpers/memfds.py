"""What a process holds of aiodist's shared-memory segments: for tests that check none leak."""

from __future__ import annotations

import os


def memfds() -> tuple[int, int]:
    """memfd mappings and fds of aiodist segments in this process."""
    with open("/proc/self/maps") as f:
        maps = sum("memfd:aiodist-shm" in line for line in f)
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:aiodist-shm" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return maps, fds
