"""Which address a rank advertises to its peers, and on which interfaces (pure decisions apart
from the few system look-ups at the top).

Order of precedence (docs/multi_host.md):
1. ``AIODIST_SOCKET_IFNAME`` (wins) or ``GLOO_SOCKET_IFNAME``: comma-separated interface names;
   each one's address of the job's family is advertised, one connection per interface per pair
   of ranks (several: large collective messages are striped across them). An interface that
   does not exist, or has no address of the family, is refused at once.
2. ``AIODIST_ADVERTISE_ADDR``: an address (or name) to advertise as is; ``aiodist-run
   --local-addr`` sets it for its workers.
3. The local address of the route to the rendezvous host (what a socket connected towards
   MASTER_ADDR gets): reachable by the peers whenever the rendezvous host is. A loopback address
   only when the rendezvous host is written as one (127.x, ::1, localhost): a single-host job.
4. Otherwise (no rendezvous host: FileStore, HashStore; or a rendezvous name that maps to
   loopback here only, as ``MASTER_ADDR=$(hostname)`` does on the rendezvous host itself under
   Debian's 127.0.1.1 line): the host name's address when it is not a loopback one, else the
   source address of the default route, else the first non-loopback interface address, else
   127.0.0.1.

Never ``gethostname()`` blindly: Debian and Ubuntu map it to 127.0.1.1 in /etc/hosts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from aiodist.errors import DistNetworkError

__all__ = ["Advertised", "ENV_ADDR", "ENV_IFNAME", "GLOO_ENV_IFNAME", "choose", "interfaces", "parse_ifnames", "route_source"]

ENV_IFNAME = "AIODIST_SOCKET_IFNAME"
GLOO_ENV_IFNAME = "GLOO_SOCKET_IFNAME"
ENV_ADDR = "AIODIST_ADVERTISE_ADDR"

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True, slots=True)
class Advertised:
    """What a rank advertises: one address per lane (interface), and why."""

    hosts: tuple[str, ...]  # lane j's address; at least one
    ifnames: tuple[str, ...]  # the interfaces named by the environment (empty: none named)
    bind: bool  # dial each lane from its own address (interfaces named)
    why: str  # how the address was chosen, for the INFO log and stats


def interfaces() -> dict[str, list[str]]:
    """Every interface with its addresses (IPv4 first, then global-scope IPv6); an interface
    with no address maps to an empty list. Linux reads /proc for IPv6; elsewhere only IPv4."""
    out: dict[str, list[str]] = {}
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        out[name] = []
        v4 = _ipv4_of(name)
        if v4 is not None:
            out[name].append(v4)
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6:
                    continue
                raw, scope, name = parts[0], int(parts[3], 16), parts[5]
                if scope != 0:  # link-local (0x20), host (0x10), ...: not dialable without a scope id
                    continue
                addr = str(ipaddress.IPv6Address(bytes.fromhex(raw)))
                out.setdefault(name, []).append(addr)
    except (OSError, ValueError):
        pass
    return out


def _ipv4_of(name: str) -> str | None:
    try:
        import fcntl  # POSIX; SIOCGIFADDR is Linux's (elsewhere the ioctl fails: no address found)
    except ImportError:
        return None
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])


def route_source(host: str, port: int = 9) -> str | None:
    """The local address of the route to ``host`` (a UDP connect sends nothing); None when the
    host does not resolve or has no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            s.connect(sockaddr)
            addr = s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
        return str(addr).split("%", 1)[0]
    return None


def parse_ifnames(env: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """(the variable used, the interface names) from the environment; ``AIODIST_SOCKET_IFNAME``
    wins over ``GLOO_SOCKET_IFNAME``. Empty names (``"eth0,,eth1"``) are refused."""
    for var in (ENV_IFNAME, GLOO_ENV_IFNAME):
        raw = env.get(var, "").strip()
        if raw:
            names = tuple(n.strip() for n in raw.split(","))
            if any(not n for n in names):
                raise DistNetworkError(f"{var}={raw!r} has an empty interface name")
            if len(set(names)) != len(names):
                raise DistNetworkError(f"{var}={raw!r} names an interface twice")
            return var, names
    return "", ()


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _family_of(addr: str | None) -> int | None:
    if addr is None:
        return None
    try:
        return socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
    except ValueError:
        return None


def _of_family(addrs: list[str], family: int) -> list[str]:
    return [a for a in addrs if _family_of(a) == family]


def choose(
    rendezvous_host: str | None,
    env: Mapping[str, str] | None = None,
    *,
    ifaces: Mapping[str, list[str]] | None = None,
    route: str | None | Literal[False] = False,
) -> Advertised:
    """The address(es) this rank advertises (see the module docstring). ``ifaces`` and ``route``
    (the route source towards the rendezvous host; False: look it up) are for tests."""
    env = os.environ if env is None else env
    src: str | None
    if route is False:
        src = route_source(rendezvous_host) if rendezvous_host else None
    else:
        src = route
    var, names = parse_ifnames(env)
    if names:
        have = interfaces() if ifaces is None else ifaces
        family = _family_of(src) or _family_of(rendezvous_host) or socket.AF_INET
        fam = "IPv6" if family == socket.AF_INET6 else "IPv4"
        hosts: list[str] = []
        for name in names:
            if name not in have:
                raise DistNetworkError(
                    f"{var}={env.get(var)!r} names interface {name!r}, which does not exist on this host; "
                    f"interfaces here: {', '.join(sorted(have)) or '(none)'}"
                )
            got = _of_family(have[name], family)
            if not got:
                raise DistNetworkError(
                    f"{var}={env.get(var)!r} names interface {name!r}, which has no {fam} address "
                    f"(the rendezvous host {rendezvous_host!r} is {fam}); its addresses: {', '.join(have[name]) or '(none)'}"
                )
            hosts.append(got[0])
        return Advertised(tuple(hosts), names, True, f"{var}={','.join(names)}")
    explicit = env.get(ENV_ADDR, "").strip()
    if explicit.startswith("[") and explicit.endswith("]"):
        explicit = explicit[1:-1]  # "[fd00::1]", as an endpoint writes it
    if explicit:
        return Advertised((explicit,), (), False, f"{ENV_ADDR}={explicit}")
    if src is not None and not _is_loopback(src):
        return Advertised((src,), (), False, f"the route to the rendezvous host {rendezvous_host}")
    if src is not None and rendezvous_host is not None and _is_loopback_literal(rendezvous_host):
        return Advertised((src,), (), False, f"the route to the rendezvous host {rendezvous_host} (a single-host job)")
    # No rendezvous host, or a name that resolves to loopback here only (MASTER_ADDR=$(hostname)
    # on the rendezvous host itself, where /etc/hosts maps it to 127.0.1.1): the address of the
    # default route, else the first non-loopback interface address.
    why = (
        "no route to the rendezvous host" if rendezvous_host is None else f"the rendezvous host {rendezvous_host} is on loopback only here"
    )
    return Advertised((_fallback(ifaces, probe=ifaces is None),), (), False, f"{why}: this host's primary address")


def _is_loopback_literal(host: str) -> bool:
    """127.x, ::1 or localhost as written: a single-host job, not a name that happens to map to
    127.0.1.1 on this host only."""
    return _is_loopback(host.strip("[]"))


# Addresses of documentation networks (RFC 5737, RFC 3849): a UDP connect towards them finds
# the default route's source address and sends nothing.
_DEFAULT_ROUTE_PROBES = ("192.0.2.1", "2001:db8::1")


def _fallback(ifaces: Mapping[str, list[str]] | None, probe: bool = True) -> str:
    try:
        name_addr = socket.gethostbyname(socket.gethostname())
        if not _is_loopback(name_addr):
            return name_addr
    except OSError:
        pass
    if probe:
        for target in _DEFAULT_ROUTE_PROBES:
            src = route_source(target)
            if src is not None and not _is_loopback(src):
                return src
    have = interfaces() if ifaces is None else ifaces
    for fam in (socket.AF_INET, socket.AF_INET6):
        for name in sorted(have):
            for a in _of_family(have[name], fam):
                if not _is_loopback(a):
                    return a
    return "127.0.0.1"
