"""``python -m aiodist.bench store --placement``: where the server and the clients are pinned
(a one-op-at-a-time rate jumps between two levels with it, docs/benchmarks.md)."""

from __future__ import annotations

import os
import threading

import pytest

from aiodist.bench.store import PLACEMENTS, Job, _pin_process, _placed, parse_args


def test_placements() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert _placed("os", 3) == (None, ())
    server, clients = _placed("same", 3)
    assert server == cpus[0] and clients == (cpus[0],) * 3
    server, clients = _placed("split", 3)
    assert server == cpus[0] and len(clients) == 3
    if len(cpus) > 1:
        assert server not in clients and set(clients) <= set(cpus[1:])
    job = Job("aiodist", 1, 1, 3, 10, "p", 1.0, cpus=clients)
    assert [job.cpu(i) for i in range(3)] == list(clients)
    assert Job("aiodist", 1, 1, 3, 10, "p", 1.0).cpu(2) is None


def test_pinning_moves_every_thread_and_back() -> None:
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        _pin_process(os.getpid(), cpu, allowed)
        assert os.sched_getaffinity(0) == {cpu}
        assert os.sched_getaffinity(t.native_id) == {cpu}
    finally:
        _pin_process(os.getpid(), None, allowed)
        stop.set()
        t.join()
    assert os.sched_getaffinity(0) == allowed


def test_placement_option() -> None:
    assert parse_args([]).placement == "os"
    assert parse_args(["--placement", "split"]).placement == "split"
    assert set(PLACEMENTS) == {"os", "same", "split"}
    with pytest.raises(SystemExit):
        parse_args(["--placement", "nowhere"])
