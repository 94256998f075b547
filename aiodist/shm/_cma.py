"""Single-copy reads of a same-host peer's memory: Linux's ``process_vm_readv`` (cross-memory
attach, "CMA"), the mechanism Open MPI's shared-memory transport uses for large messages.

Why: a big all_gather through the segments moves every byte twice (the owner copies its part
into its segment, each peer copies it out); with CMA each peer copies the part straight from
the owner's input into its output, once (docs/transport.md, "Single-copy all_gather").

Rules this module keeps:
- It is tried only where ``process_vm_readv`` exists (Linux, through ctypes: the call releases
  the GIL and copies in the kernel) and ``AIODIST_SHM_CMA`` is not ``0``.
- Whether a rank can read a peer is found out, not assumed: every rank publishes the address of
  16 random bytes of its own (``record``), and a peer reads them back through the pid in that
  record (``readable``). Only the same bytes count, so a peer in another pid namespace (where
  that pid is another process), a ptrace policy that forbids it, or a seccomp filter each send
  the group down the two-copy path, never a wrong read.
- Where the kernel's Yama module restricts ptrace to descendants (``ptrace_scope`` 1), a rank
  lets same-user processes read it (``PR_SET_PTRACER_ANY``), as Open MPI does; scope 2 or 3
  forbids it and the probe fails.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
from typing import Any

import numpy as np

__all__ = ["ENV", "record", "readable", "read", "enabled"]

log = logging.getLogger("aiodist.shm")

ENV = "AIODIST_SHM_CMA"
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv: Any = None  # libc's process_vm_readv, once loaded; False where there is none
_probe: np.ndarray | None = None  # this process's 16 random bytes, at a fixed address while it lives


def _forget() -> None:
    """In a forked child: load again (Yama's ptracer exception is not inherited) and make its
    own probe bytes (a sibling with the same ones, at the same address, could pass for it)."""
    global _readv, _probe
    _readv = None
    _probe = None


os.register_at_fork(after_in_child=_forget)


def _load() -> Any:
    global _readv
    if _readv is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            f = libc.process_vm_readv
            f.restype = ctypes.c_ssize_t
            f.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
            _readv = f
            _allow_peers(libc)
        except (OSError, AttributeError):
            _readv = False
    return _readv


def _allow_peers(libc: Any) -> None:
    """Under Yama's ptrace_scope 1 only an ancestor may read a process: let same-user peers."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        return  # no Yama: same-user processes may read each other
    if scope == "1":
        prctl = libc.prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        if prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0:
            log.info("pid %d: let same-user processes read this one (Yama ptrace_scope 1) for single-copy shared memory", os.getpid())


def enabled(env: dict[str, str] | None = None) -> bool:
    """``AIODIST_SHM_CMA`` (default 1): 0 keeps every shared-memory op on the two-copy path."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ENV}={raw!r}: expected 1 (single-copy reads where the kernel allows them) or 0 (never)")
    return raw != "0"


def record() -> dict[str, Any] | None:
    """What a peer needs to check it can read this process (its part of the shared-memory
    record), or None where this process has no ``process_vm_readv``."""
    global _probe
    if not _load():
        return None
    if _probe is None:
        _probe = np.frombuffer(bytearray(secrets.token_bytes(16)), np.uint8)
    return {"addr": int(_probe.ctypes.data), "bytes": _probe.tobytes().hex()}


def readable(pid: Any, rec: Any) -> bool:
    """Whether this process reads the probe bytes of ``rec`` (a peer's ``record()``) at its
    ``pid``: the same process, reachable, and allowed."""
    if not _load() or not isinstance(pid, int) or not isinstance(rec, dict):
        return False
    try:
        want = bytes.fromhex(rec["bytes"])
        addr = int(rec["addr"])
    except (KeyError, TypeError, ValueError):
        return False
    got = np.zeros(len(want), np.uint8)
    try:
        read(pid, got, addr)
    except OSError:
        return False
    return got.tobytes() == want


def read(pid: int, dst: np.ndarray, addr: int) -> None:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into ``dst`` (a contiguous,
    writable byte array); OSError with the kernel's errno where the read fails (a peer gone:
    ESRCH; not allowed: EPERM; memory not mapped there: EFAULT)."""
    n = dst.nbytes
    base = dst.ctypes.data
    done = 0
    while done < n:
        local = _IoVec(base + done, n - done)
        remote = _IoVec(addr + done, n - done)
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        if got == 0:
            raise OSError(errno.EFAULT, os.strerror(errno.EFAULT))
        done += got
