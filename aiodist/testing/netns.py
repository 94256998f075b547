"""Several "hosts" on one Linux machine: network namespaces joined by virtual links, for tests and
benchmarks that need ranks on different hosts (different addresses, separate interfaces,
cross-host TCP) without a cluster. Stdlib only; needs root and iproute2 (``ip``, ``tc``).

    from aiodist.testing import netns

    if (why := netns.unavailable_reason()) is None:
        with netns.make_hosts(2, links=2, rate="1gbit") as hosts:
            p = hosts.popen(0, [sys.executable, "job.py"], env=env, stdout=out)
            hosts.addr(1, link=1)             # '10.X.1.2': host 1's address on eth1
            hosts.counters(0, "eth1")         # (rx_bytes, tx_bytes) of host 0's eth1
            hosts.link_down(1, i=0)           # host 0's eth1 goes down

Topology. Host ``i`` is namespace ``hosts.names[i]``, with ``lo`` up and, for every link
(segment) ``j``, a device ``eth{j}`` holding ``10.X.j.(i+1)/24`` (``ipv4``) and/or
``fdXX:j::(i+1)/64`` (``ipv6``, no duplicate address detection, so usable at once). Two hosts
share one veth pair per segment; three or more are ports of one bridge per segment (``br{j}``)
in a separate "switch" namespace. Segments are separate L2 networks: host 0's ``eth1`` only
reaches the others' ``eth1`` addresses. Every namespace is its own network stack, so addresses of
concurrent Hosts cannot clash; the block ``X`` still differs between them, for readable logs.

``rate="1gbit"`` shapes every host device (``tc qdisc ... root tbf rate 1gbit burst 256kb
latency 50ms``): each host sends at most ``rate`` per link. ``hostname_on_loopback=True``
writes ``/etc/netns/<name>/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts``) mapping
this machine's hostname to 127.0.1.1, as Debian does: every host has the same hostname, and
it resolves to loopback, as on many real clusters.

Processes: ``popen``/``run`` start ``ip netns exec NAME cmd...`` (which execs ``cmd``: the pid
is the command's) in its own session, and remember it. ``close()`` (also ``__exit__``, on any
exception, and at interpreter exit) SIGKILLs each remembered process's group, then every pid
still in the namespaces (``ip netns pids``), deletes every device, bridge and namespace it made
and ``/etc/netns/<name>``. Namespace names carry the creating pid; ``make_hosts`` first removes
the namespaces (and their processes) of an earlier Hosts whose creating process is gone (a run
killed before it could clean up).

In a pytest fixture (pytest stays out of this module):

    @pytest.fixture
    def hosts():
        yield from netns.managed(2)
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

__all__ = ["Family", "Hosts", "NetnsError", "cleanup_stale", "make_hosts", "managed", "unavailable_reason"]

DEFAULT_PREFIX = "aiodist"
Family = Literal["ipv4", "ipv6"]

_counter = itertools.count()
_live: set[Hosts] = set()
_lock = threading.Lock()


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command needed to build the hosts failed (its command line and stderr)."""


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not Linux, not root, no ``ip``/``tc``, ``ip netns add``
    or a veth pair refused), or None when they can. Probed once per process."""
    if not hasattr(os, "geteuid") or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    a, b = f"{DEFAULT_PREFIX}-probe-{os.getpid()}-a", f"{DEFAULT_PREFIX}-probe-{os.getpid()}-b"
    try:
        for ns in (a, b):
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                return f"`ip netns add` failed: {r.stderr.strip()}"
        r = _ip("link", "add", "eth0", "netns", a, "type", "veth", "peer", "name", "eth0", "netns", b, check=False)
        if r.returncode != 0:
            return f"cannot make a veth pair between namespaces: {r.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run ip: {e}"
    finally:
        for ns in (a, b):
            _ip("-n", ns, "link", "del", "eth0", check=False)
        for ns in (a, b):
            _ip("netns", "del", ns, check=False)


def _netns_list() -> list[str]:
    r = _ip("-j", "netns", "list", check=False)
    try:
        return [str(e["name"]) for e in json.loads(r.stdout or "[]")]
    except (ValueError, KeyError, TypeError):
        return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str, rounds: int = 20) -> None:
    """SIGKILL every process in namespace ``ns`` (only namespaces made here are ever passed)."""
    for _ in range(rounds):
        r = _ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def _delete_netns(ns: str) -> None:
    """Kill what runs in ``ns``, delete its devices (a veth peer may not go away with its
    namespace on every kernel), the namespace and ``/etc/netns/<ns>``."""
    if ns in _netns_list():
        _kill_netns_pids(ns)
        r = _ip("-n", ns, "-j", "link", "show", check=False)
        try:
            devs = [str(d["ifname"]) for d in json.loads(r.stdout or "[]")]
        except (ValueError, KeyError, TypeError):
            devs = []
        for dev in devs:
            if dev != "lo":
                _ip("-n", ns, "link", "del", dev, check=False)
        _ip("netns", "del", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


_NAME = re.compile(r"^(?P<prefix>.+)-(?P<pid>\d+)-(?P<n>\d+)-(?:h\d+|sw)$")


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete the namespaces named ``<prefix>-<pid>-<k>-...`` whose creating process ``pid`` is
    gone, with whatever still runs in them; returns their names."""
    gone = []
    for ns in _netns_list():
        m = _NAME.match(ns)
        if m and m["prefix"] == prefix and not _pid_alive(int(m["pid"])):
            _delete_netns(ns)
            gone.append(ns)
    return gone


class Hosts:
    """``n`` hosts (network namespaces) joined by ``links`` segments; see the module docstring.
    Made by :func:`make_hosts`; a context manager (``close()`` on exit)."""

    def __init__(self, n: int, links: int, *, ipv4: bool, ipv6: bool, rate: str | None, hostname_on_loopback: bool, prefix: str) -> None:
        if n < 2:
            raise ValueError(f"need at least 2 hosts, got {n}")
        if not 1 <= links <= 16:
            raise ValueError(f"links must be 1..16, got {links}")
        if not (ipv4 or ipv6):
            raise ValueError("need ipv4 or ipv6 (or both)")
        k = next(_counter)
        base = f"{prefix}-{os.getpid()}-{k}"
        self.n, self.links, self.ipv4, self.ipv6, self.rate = n, links, ipv4, ipv6, rate
        self.names: list[str] = [f"{base}-h{i}" for i in range(n)]
        self.switch: str | None = f"{base}-sw" if n >= 3 else None
        self.block = 20 + (os.getpid() * 7 + k) % 200  # X in 10.X.j.i and fdXX:j::i
        self.hostname = socket.gethostname()
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        self._closed = False
        with _lock:
            _live.add(self)
        try:
            self._build(hostname_on_loopback)
        except BaseException:
            self.close()
            raise

    # --- construction -------------------------------------------------------------------------

    def _netns_add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _build(self, hostname_on_loopback: bool) -> None:
        for ns in self.names:
            self._netns_add(ns)
            if hostname_on_loopback:
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(
                        "127.0.0.1\tlocalhost\n"
                        f"127.0.1.1\t{self.hostname}\n"
                        "::1\tlocalhost ip6-localhost ip6-loopback\n"
                        "ff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"
                    )
        if self.switch is not None:
            self._netns_add(self.switch)
        for j in range(self.links):
            dev = f"eth{j}"
            if self.switch is None:
                _ip("link", "add", dev, "netns", self.names[0], "type", "veth", "peer", "name", dev, "netns", self.names[1])
            else:
                _ip("-n", self.switch, "link", "add", f"br{j}", "type", "bridge")
                _ip("-n", self.switch, "link", "set", f"br{j}", "up")
                for i, ns in enumerate(self.names):
                    port = f"l{j}h{i}"
                    _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                    _ip("-n", self.switch, "link", "set", port, "master", f"br{j}")
                    _ip("-n", self.switch, "link", "set", port, "up")
            for i, ns in enumerate(self.names):
                if self.ipv4:
                    _ip("-n", ns, "addr", "add", f"{self.addr(i, j, 'ipv4')}/24", "dev", dev)
                if self.ipv6:
                    _ip("-n", ns, "addr", "add", f"{self.addr(i, j, 'ipv6')}/64", "dev", dev, "nodad")
                _ip("-n", ns, "link", "set", dev, "up")
                if self.rate is not None:
                    self._tc(i, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms")
        self.wait_up()

    def _tc(self, i: int, *args: str) -> None:
        r = subprocess.run(self.argv(i, ["tc", *args]), capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise NetnsError(f"`tc {' '.join(args)}` on {self.names[i]} failed ({r.returncode}): {r.stderr.strip()}")

    def wait_up(self, links: Sequence[int] | None = None, timeout: float = 10.0) -> None:
        """Return once every ``eth{j}`` (j in ``links``, default all) that is set up has its
        carrier (``LOWER_UP``) on every host; NetnsError naming the ones that do not after
        ``timeout`` seconds. (A veth whose peer is down has no carrier: with two hosts, call this
        only for links that are up on both.)"""
        want = {f"eth{j}" for j in (range(self.links) if links is None else links)}
        deadline = time.monotonic() + timeout
        while True:
            down = []
            for ns in self.names:
                for d in json.loads(_ip("-n", ns, "-j", "link", "show").stdout or "[]"):
                    flags = d.get("flags", [])
                    if d.get("ifname") in want and "UP" in flags and "LOWER_UP" not in flags:
                        down.append(f"{ns}:{d['ifname']}")
            if not down:
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"no carrier after {timeout} s on {', '.join(down)}")
            time.sleep(0.02)

    # --- addresses ----------------------------------------------------------------------------

    def _family(self, family: Family | None) -> Family:
        if family is None:
            return "ipv4" if self.ipv4 else "ipv6"
        if family == "ipv4" and not self.ipv4 or family == "ipv6" and not self.ipv6:
            raise ValueError(f"these hosts have no {family} addresses")
        return family

    def addr(self, i: int, link: int = 0, family: Family | None = None) -> str:
        """Host ``i``'s address on ``eth{link}`` (no prefix length); IPv4 unless the hosts are IPv6-only."""
        if not 0 <= i < self.n or not 0 <= link < self.links:
            raise IndexError(f"no host {i} / link {link} (hosts 0..{self.n - 1}, links 0..{self.links - 1})")
        if self._family(family) == "ipv4":
            return f"10.{self.block}.{link}.{i + 1}"
        return str(ipaddress.IPv6Address(f"fd{self.block:02x}:{link}::{i + 1}"))  # compressed, as sockets print it

    def hostport(self, i: int, port: int, link: int = 0, family: Family | None = None) -> str:
        """``addr:port``, with the address bracketed for IPv6 (``[fd14::1]:29400``)."""
        a = self.addr(i, link, family)
        return f"[{a}]:{port}" if ":" in a else f"{a}:{port}"

    @property
    def ifnames(self) -> list[str]:
        """The host devices' names, ``['eth0', ..., 'eth{links-1}']`` (the same on every host)."""
        return [f"eth{j}" for j in range(self.links)]

    # --- processes ----------------------------------------------------------------------------

    def argv(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run in host ``i``: ``['ip', 'netns', 'exec', NAME, *cmd]``."""
        return ["ip", "netns", "exec", self.names[i], *cmd]

    def popen(self, i: int, cmd: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in host ``i`` in a new session (its pid is its process group) and track it:
        ``close()`` kills its group. Keyword arguments go to ``subprocess.Popen`` (stdin defaults to
        /dev/null)."""
        if self._closed:
            raise RuntimeError("these hosts are closed")
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw["start_new_session"] = True
        p: subprocess.Popen[Any] = subprocess.Popen(self.argv(i, cmd), env=None if env is None else dict(env), **kw)
        self._procs.append(p)
        return p

    def run(
        self, i: int, cmd: Sequence[str], timeout: float = 30.0, env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in host ``i`` to completion, output captured as text. Past ``timeout``
        seconds its process group is killed and ``subprocess.TimeoutExpired`` raised (with the
        output so far)."""
        p = self.popen(i, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    # --- links --------------------------------------------------------------------------------

    def _set(self, link: int, i: int | None, state: str) -> None:
        for h in range(self.n) if i is None else [i]:
            _ip("-n", self.names[h], "link", "set", f"eth{link}", state)

    def link_down(self, link: int, i: int | None = None) -> None:
        """Set ``eth{link}`` down on host ``i`` (on every host when ``i`` is None)."""
        self._set(link, i, "down")

    def link_up(self, link: int, i: int | None = None) -> None:
        """Set ``eth{link}`` up again on host ``i`` (every host when None); returns once its carrier
        is back (NetnsError after 10 s: with two hosts, when the peer's end is still down)."""
        self._set(link, i, "up")
        self.wait_up([link])

    def counters(self, i: int, dev: str = "eth0") -> tuple[int, int]:
        """``(rx_bytes, tx_bytes)`` of device ``dev`` in host ``i``."""
        stats = f"/sys/class/net/{dev}/statistics"
        r = self.run(i, ["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"], timeout=10)
        if r.returncode != 0:
            raise NetnsError(f"cannot read {dev}'s counters in {self.names[i]}: {r.stderr.strip()}")
        rx, tx = r.stdout.split()
        return int(rx), int(tx)

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started here (its group) and every other pid in the namespaces,
        delete the devices, bridges, namespaces and /etc/netns entries. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for p in self._procs:
                _killpg(p)
            for ns in reversed(self._made):
                _delete_netns(ns)
            for ns in self.names:  # /etc/netns/<ns> may exist without its namespace (a failed build)
                shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        finally:
            with _lock:
                _live.discard(self)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<Hosts {self.names} links={self.links} ipv4={self.ipv4} ipv6={self.ipv6} rate={self.rate}{' closed' if self._closed else ''}>"
        )


def _killpg(p: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group of ``p`` (a session leader: group id == pid) and reap ``p``."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                p.kill()
            except ProcessLookupError:
                pass
    else:
        try:  # the leader is gone, its group may not be
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for stream in (p.stdout, p.stderr):
        if stream is not None and not stream.closed:
            stream.close()


def make_hosts(
    n: int,
    links: int = 1,
    *,
    ipv4: bool = True,
    ipv6: bool = False,
    rate: str | None = None,
    hostname_on_loopback: bool = True,
    prefix: str = DEFAULT_PREFIX,
) -> Hosts:
    """Build ``n`` hosts joined by ``links`` segments (see the module docstring); first removes
    stale namespaces of dead runs with the same ``prefix``. Raises NetnsError (after cleaning up
    what it made) when a step fails."""
    if (why := unavailable_reason()) is not None:
        raise NetnsError(why)
    cleanup_stale(prefix)
    return Hosts(n, links, ipv4=ipv4, ipv6=ipv6, rate=rate, hostname_on_loopback=hostname_on_loopback, prefix=prefix)


def managed(n: int, links: int = 1, **kw: Any) -> Iterator[Hosts]:
    """A generator for a pytest fixture: yields ``make_hosts(n, links, **kw)`` and closes it after."""
    with make_hosts(n, links, **kw) as hosts:
        yield hosts


@atexit.register
def _close_all() -> None:
    with _lock:
        live = list(_live)
    for h in live:
        h.close()


if __name__ == "__main__":  # python -m aiodist.testing.netns [PREFIX...]: probe, and clean up after dead runs
    import sys

    reason = unavailable_reason()
    print(f"network namespaces: {'available' if reason is None else 'unavailable: ' + reason}")
    if reason is None:
        for prefix in sys.argv[1:] or [DEFAULT_PREFIX]:
            for name in cleanup_stale(prefix):
                print(f"removed stale {name}")
