"""64 TCPStore clients x 1,000 ``add(key, 1)`` on one key against a standalone server process
(``python -m aiodist.store``), with two of the eight client processes SIGKILLed mid-way (each
runs eight client connections). Every client logs into a shared file (an mmap, which a
SIGKILL leaves intact) how many adds it has sent and how many were acknowledged, and the
value each acknowledged add returned. At the end:

- the survivors all finished their 1,000 adds (the server kept serving through the kills);
- final counter == acknowledged adds of all clients + k, with 0 <= k <= the adds in flight at
  the kill (sent, not acknowledged: at most one per connection of a killed process). An add in
  flight when its client dies may or may not have been applied; torch's TCPStore is the same;
- every acknowledged add returned a distinct value in 1..final (each add applied once,
  atomically; the k values nobody saw belong to in-flight adds that were applied).

In these runs every in-flight add was applied (k = 16 of 16 when the victims ran flat out,
1-2 of 1-2 since they slow down past their first third, over aiodist's same-host Unix socket
as here, and over TCP when tried): a SIGKILL mostly lands while a client awaits the reply to
an add the server has already applied. An add whose bytes had not left the client
(or that a TCP reset discarded) is not applied; the assertion allows both.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from aiodist import TCPStore

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

PROCS = 8  # client processes ...
CONNS = 8  # ... of this many client connections each: 64 clients
ADDS = 1000  # per client
VICTIMS = (2, 5)  # the client processes SIGKILLed
KILL_AT = ADDS // 3  # once every connection of both victims has this many adds acknowledged
KEY = "counter"
START_S = 60.0  # start-up of 9 interpreters on 2 cores, and the victims' first third
RUN_S = 60.0  # the survivors' remaining adds (the whole run takes 10-20 s)
SLOT = 2 + ADDS  # per client in the log: sent, acknowledged, then each acknowledged add's value

ROOT = Path(__file__).resolve().parents[2]

CLIENT = ROOT / "tests" / "helpers" / "store_adds_client.py"  # CONNS connections of ADDS adds each, logged to a shared file


def _server_port(server: subprocess.Popen[str], deadline: float) -> int:
    """The port from the server's "listening on host:port" line."""
    assert server.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(server.stdout, selectors.EVENT_READ)
        seen = []
        while (left := deadline - time.monotonic()) > 0 and sel.select(timeout=left):
            line = server.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "listening on" in line:
                return int(line.rsplit(":", 1)[1])
    raise AssertionError(f"the store server did not report its port: {seen}")


def _wait_for(cond: Callable[[], bool], deadline: float, what: str) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def _final_count(port: int) -> int:
    async with TCPStore("127.0.0.1", port, timeout=10) as store:
        return int(await store.get(KEY))


def test_64_clients_1000_adds_two_client_processes_killed(tmp_path: Path) -> None:
    log_path = tmp_path / "adds.log"
    log_path.write_bytes(b"\0" * (PROCS * CONNS * SLOT * 8))
    client_args = ["--log", str(log_path), "--key", KEY, "--conns", str(CONNS), "--adds", str(ADDS), "--clients", str(PROCS * CONNS)]
    client_args += ["--kill-at", str(KILL_AT), "--victims", ",".join(map(str, VICTIMS))]
    log = np.memmap(log_path, dtype=np.int64, mode="r", shape=(PROCS, CONNS, SLOT))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server_log = tmp_path / "server.log"
    with server_log.open("w") as server_err:
        server = subprocess.Popen(
            [sys.executable, "-m", "aiodist.store", "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=server_err,
            text=True,
        )
    clients: list[subprocess.Popen[str]] = []
    t0 = time.monotonic()
    try:
        port = _server_port(server, time.monotonic() + START_S)
        for proc in range(PROCS):
            clients.append(
                subprocess.Popen(
                    [sys.executable, str(CLIENT), *client_args, "--port", str(port), "--proc", str(proc)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        # each victim is killed once all its connections have a third of their adds acknowledged
        # (one at a time: waiting for both once let the first finish all its adds; and past
        # that third a victim slows to an add per 2 ms, so the kill always lands mid-run)
        at_kill = np.zeros_like(log[:, :, 1])  # acknowledged adds per client when its process died (approximately)
        for v in VICTIMS:
            _wait_for(lambda v=v: log[v, :, 1].min() >= KILL_AT, time.monotonic() + START_S, f"victim {v}'s first third")
            os.kill(clients[v].pid, signal.SIGKILL)
            at_kill[v] = log[v, :, 1]
        t_kill = time.monotonic() - t0
        survivors = [q for q in range(PROCS) if q not in VICTIMS]
        at_kill[survivors] = log[survivors, :, 1]
        outs = []
        deadline = time.monotonic() + RUN_S
        for c in clients:
            out, _ = c.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
        t_done = time.monotonic() - t0
        final = asyncio.run(_final_count(port))
        assert server.poll() is None, "the store server died"
    finally:
        for p in [*clients, server]:
            if p.poll() is None:
                p.kill()
        for p in [*clients, server]:
            p.wait(timeout=10)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()

    logged = server_log.read_text()
    assert "Traceback" not in logged and " ERROR " not in logged and " CRITICAL " not in logged, logged
    sent, acked = log[:, :, 0].copy(), log[:, :, 1].copy()
    for proc, c in enumerate(clients):
        if proc in VICTIMS:
            assert c.returncode == -signal.SIGKILL, f"client process {proc}: {c.returncode}\n{outs[proc]}"
        else:
            assert c.returncode == 0 and "done" in outs[proc], f"client process {proc} exited with {c.returncode}:\n{outs[proc]}"
            assert (acked[proc] == ADDS).all(), f"survivor {proc} did not finish its adds: {acked[proc]}"
    in_flight = int((sent - acked).sum())
    assert ((sent - acked) >= 0).all() and ((sent - acked) <= 1).all(), "a client had more than one add in flight"
    total_acked = int(acked.sum())
    k = final - total_acked
    victims_at_kill = [int(at_kill[v].sum()) for v in VICTIMS]
    print(
        f"{PROCS * CONNS} clients x {ADDS} adds, processes {list(VICTIMS)} killed at {victims_at_kill} acknowledged adds "
        f"(survivors then at {int(at_kill.sum()) - sum(victims_at_kill)} of {(PROCS - len(VICTIMS)) * CONNS * ADDS}): "
        f"final {final} = acknowledged {total_acked} + {k} of {in_flight} in flight; killed at {t_kill:.1f} s, survivors done at {t_done:.1f} s"
    )
    assert 0 <= k <= in_flight, f"final {final}: acknowledged {total_acked}, in flight {in_flight}"
    assert in_flight <= len(VICTIMS) * CONNS
    # every acknowledged add saw its own value: each add was applied once, atomically
    seen = np.concatenate([log[p, c, 2 : 2 + acked[p, c]] for p in range(PROCS) for c in range(CONNS)])
    assert len(seen) == total_acked and len(np.unique(seen)) == total_acked, "two acknowledged adds returned the same value"
    assert seen.min() >= 1 and seen.max() <= final, (seen.min(), seen.max(), final)
