"""Which address a rank advertises, interface lanes and striping, and connection failures that
show while they happen, below the multi-host tests of tests/test_multihost.py:

- ``aiodist.transport._ifaces.choose`` as a pure decision over a given interface table and
  route (the 127.0.1.1 pitfall, IFNAME precedence, unknown interfaces, families);
- ``stripe_parts`` (hypothesis), PeerAddress's lanes on the wire, HELLO's lane;
- Transports on one loop that believe they are on different hosts (distinct host ids), with two
  lanes over 127.0.0.1 and 127.0.0.2: big collective messages are split across both lanes'
  connections, p2p and small messages stay on lane 0, a lane-count mismatch fails every rank;
- a peer whose published address refuses: a warning while it lasts, and the timeout says that
  no connection to it was ever made, with the address and the last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodist import DistNetworkError, DistTimeoutError, HashStore
from aiodist.backends.aio import rendezvous_host
from aiodist.backends.base import P2P_SEQ
from aiodist.store import PrefixStore
from aiodist.transport import PeerAddress, Transport, address_key
from aiodist.transport import _dialer as dialer_mod
from aiodist.transport import _transport as transport_mod
from aiodist.transport._ifaces import Advertised, choose, interfaces, parse_ifnames, route_source
from aiodist.transport._striping import stripe_parts
from aiodist.wire.frame import FrameDecoder, FrameLimits, Hello, HelloReceived, hello_frame

pytestmark = pytest.mark.timeout(60)

IFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5", "fd00::5"], "eth1": ["10.0.1.5"], "wg0": ["fd10::7"], "down0": []}


# -- choose(): the decision ------------------------------------------------------------------


def test_route_to_the_rendezvous_host_is_advertised() -> None:
    adv = choose("10.0.0.1", {}, ifaces=IFACES, route="10.0.0.5")
    assert adv.hosts == ("10.0.0.5",) and adv.ifnames == () and not adv.bind
    assert "route" in adv.why


def test_loopback_only_when_the_rendezvous_host_is_on_loopback() -> None:
    assert choose("127.0.0.1", {}, ifaces=IFACES, route="127.0.0.1").hosts == ("127.0.0.1",)
    # a route source on loopback towards a host that is not (a misrouted name): never advertised
    adv = choose("10.9.9.9", {}, ifaces=IFACES, route="127.0.1.1")
    assert adv.hosts[0] not in ("127.0.1.1", "127.0.0.1")


def test_a_rendezvous_name_on_loopback_here_only_is_not_advertised() -> None:
    # MASTER_ADDR=node-a on node-a itself, whose /etc/hosts maps node-a to 127.0.1.1: the route
    # source is loopback, but the peers reach node-a by another address
    adv = choose("node-a", {}, ifaces=IFACES, route="127.0.0.1")
    assert adv.hosts == ("10.0.0.5",) and "loopback only here" in adv.why
    assert choose("localhost", {}, ifaces=IFACES, route="127.0.0.1").hosts == ("127.0.0.1",)
    assert choose("::1", {}, ifaces=IFACES, route="::1").hosts == ("::1",)


def test_bracketed_explicit_address() -> None:
    assert choose("fd00::1", {"AIODIST_ADVERTISE_ADDR": "[fd00::5]"}, ifaces=IFACES, route="fd00::5").hosts == ("fd00::5",)


def test_no_rendezvous_host_skips_a_hostname_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    # Debian/Ubuntu: the host name maps to 127.0.1.1; the first non-loopback address is used
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert choose(None, {}, ifaces=IFACES).hosts == ("10.0.0.5",)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "192.168.7.7")
    assert choose(None, {}, ifaces=IFACES).hosts == ("192.168.7.7",)


def test_explicit_address_wins_over_the_route() -> None:
    adv = choose("10.0.0.1", {"AIODIST_ADVERTISE_ADDR": "10.0.1.5"}, ifaces=IFACES, route="10.0.0.5")
    assert adv.hosts == ("10.0.1.5",) and "AIODIST_ADVERTISE_ADDR" in adv.why


def test_ifname_lists_one_address_per_interface_and_binds() -> None:
    adv = choose("10.0.0.1", {"GLOO_SOCKET_IFNAME": "eth0, eth1"}, ifaces=IFACES, route="10.0.0.5")
    assert adv.hosts == ("10.0.0.5", "10.0.1.5") and adv.ifnames == ("eth0", "eth1") and adv.bind


def test_aiodist_ifname_wins_over_gloo() -> None:
    env = {"GLOO_SOCKET_IFNAME": "nope9", "AIODIST_SOCKET_IFNAME": "eth1"}
    assert parse_ifnames(env) == ("AIODIST_SOCKET_IFNAME", ("eth1",))
    assert choose("10.0.0.1", env, ifaces=IFACES, route="10.0.0.5").hosts == ("10.0.1.5",)


def test_ifname_wins_over_the_explicit_address() -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth1", "AIODIST_ADVERTISE_ADDR": "10.0.0.5"}
    assert choose("10.0.0.1", env, ifaces=IFACES, route="10.0.0.5").hosts == ("10.0.1.5",)


def test_unknown_interface_is_named_with_the_ones_that_exist() -> None:
    with pytest.raises(DistNetworkError) as e:
        choose("10.0.0.1", {"GLOO_SOCKET_IFNAME": "eth0,eth9"}, ifaces=IFACES, route="10.0.0.5")
    msg = str(e.value)
    assert "'eth9'" in msg and "does not exist" in msg and "down0, eth0, eth1, lo, wg0" in msg


def test_interface_without_an_address_of_the_family_is_refused() -> None:
    with pytest.raises(DistNetworkError, match=r"'down0', which has no IPv4 address"):
        choose("10.0.0.1", {"GLOO_SOCKET_IFNAME": "down0"}, ifaces=IFACES, route="10.0.0.5")
    with pytest.raises(DistNetworkError, match=r"'eth1', which has no IPv6 address"):
        choose("fd00::1", {"GLOO_SOCKET_IFNAME": "eth1"}, ifaces=IFACES, route="fd00::5")


def test_ipv6_rendezvous_picks_ipv6_addresses() -> None:
    adv = choose("fd00::1", {"AIODIST_SOCKET_IFNAME": "eth0,wg0"}, ifaces=IFACES, route="fd00::5")
    assert adv.hosts == ("fd00::5", "fd10::7")
    assert choose("fd00::1", {}, ifaces=IFACES, route="fd00::5").hosts == ("fd00::5",)


@pytest.mark.parametrize("raw", ["eth0,,eth1", "eth0,eth0", ","])
def test_malformed_ifname_lists_are_refused(raw: str) -> None:
    with pytest.raises(DistNetworkError, match="GLOO_SOCKET_IFNAME"):
        choose("10.0.0.1", {"GLOO_SOCKET_IFNAME": raw}, ifaces=IFACES, route="10.0.0.5")


def test_system_lookups_on_this_host() -> None:
    have = interfaces()
    assert "127.0.0.1" in have.get("lo", [])
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("no-such-host.invalid") is None


async def test_rendezvous_host_is_read_through_prefix_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    class Hosted(HashStore):
        host = "10.1.2.3"

    assert rendezvous_host(PrefixStore("a", PrefixStore("b", Hosted()))) == "10.1.2.3"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert rendezvous_host(HashStore()) is None
    monkeypatch.setenv("MASTER_ADDR", "10.9.8.7")
    assert rendezvous_host(HashStore()) == "10.9.8.7"


# -- on the wire -------------------------------------------------------------------------------


@given(st.integers(0, 1 << 26), st.integers(1, 8))
def test_stripe_parts_tile_the_message(nbytes: int, lanes: int) -> None:
    parts = stripe_parts(nbytes, lanes)
    assert len(parts) == lanes and parts[0][0] == 0 and parts[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    assert all(a % 64 == 0 for a, _ in parts)
    sizes = [b - a for a, b in parts]
    assert max(sizes[:-1], default=0) <= nbytes // lanes and sizes[-1] - (nbytes // lanes) < 64 * lanes


def test_peer_address_lanes_round_trip_and_old_encodings_decode() -> None:
    a = PeerAddress(3, "10.0.0.5", 4242, None, "boot/1", ("10.0.0.5", "10.0.1.5"), ("eth0", "eth1"))
    b = PeerAddress.decode(a.encode())
    assert b == a and b.lanes == ("10.0.0.5", "10.0.1.5") and b.describe(1) == "10.0.1.5:4242"
    old = b'{"rank": 1, "host": "fd00::5", "port": 7, "unix": null, "host_id": "x"}'
    c = PeerAddress.decode(old)
    assert c.lanes == ("fd00::5",) and c.ifnames == () and c.describe() == "[fd00::5]:7"


def test_hello_carries_the_lane_in_its_tag() -> None:
    dec = FrameDecoder(FrameLimits())
    frame = hello_frame(Hello(b"tok", 1, 2), lane=3)
    buf = dec.get_buffer(len(frame))
    buf[: len(frame)] = frame
    (ev,) = dec.buffer_updated(len(frame))
    assert isinstance(ev, HelloReceived) and ev.header.tag == 3 and ev.hello.rank == 1


# -- lanes over loopback, ranks on "different hosts" -------------------------------------------


@pytest.fixture
def distinct_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Transport made from now on believes it is on a host of its own (TCP, no Unix socket)."""
    ids = itertools.count()
    monkeypatch.setattr(transport_mod, "host_id", lambda: f"fake-host-{next(ids)}")


def two_lanes() -> Advertised:
    return Advertised(("127.0.0.1", "127.0.0.2"), ("lo", "lo:1"), True, "test")


async def start(n: int, store: HashStore, adv: list[Advertised], timeout: float = 10) -> list[Transport]:
    ts = list(await asyncio.gather(*(Transport.start(store, r, n, token="job", timeout=timeout, advertise=adv[r]) for r in range(n))))
    await asyncio.gather(*(t.exchange(timeout) for t in ts))
    return ts


def lane_bytes(t: Transport, peer: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for c in t.stats()["connections"]:
        if c["peer"] == peer:
            out[c["lane"]] = out.get(c["lane"], 0) + c["bytes_out"]
    return out


@pytest.mark.usefixtures("distinct_hosts")
async def test_big_collective_messages_are_split_across_the_lanes() -> None:
    store = HashStore()
    ts = await start(2, store, [two_lanes(), two_lanes()])
    try:
        assert ts[0].striped(1) and ts[1].striped(0)
        n = 4 << 20
        src = np.arange(n // 8, dtype=np.float64)
        dst = np.zeros_like(src)
        await asyncio.gather(ts[0].send(1, src, group=0, seq=5, tag=2), ts[1].recv(0, dst, group=0, seq=5, tag=2))
        np.testing.assert_array_equal(dst, src)
        sent = lane_bytes(ts[0], 1)
        assert set(sent) == {0, 1} and min(sent.values()) >= n // 2, sent
        # the other way, and a second message on the same key, in order
        back = [np.zeros(n // 8), np.zeros(n // 8)]
        await asyncio.gather(
            ts[1].send(0, src, seq=6), ts[1].send(0, src[::-1].copy(), seq=6), ts[0].recv(1, back[0], seq=6), ts[0].recv(1, back[1], seq=6)
        )
        np.testing.assert_array_equal(back[0], src)
        np.testing.assert_array_equal(back[1], src[::-1])
        # lane connections are shared both ways: one per lane per pair
        lanes = sorted(c["lane"] for c in ts[0].stats()["connections"] if c["peer"] == 1)
        assert lanes in ([0, 1], [0, 0, 1], [0, 1, 1], [0, 0, 1, 1]), lanes
    finally:
        await asyncio.gather(*(t.close() for t in ts))


@pytest.mark.usefixtures("distinct_hosts")
async def test_p2p_and_small_messages_stay_on_lane_zero() -> None:
    store = HashStore()
    ts = await start(2, store, [two_lanes(), two_lanes()])
    try:
        big = np.ones(1 << 20)
        small = np.ones(16)
        got_big, got_small = np.zeros_like(big), np.zeros_like(small)
        await asyncio.gather(
            ts[0].send(1, big, seq=P2P_SEQ, tag=1),
            ts[1].recv(0, got_big, seq=P2P_SEQ, tag=1),
            ts[0].send(1, small, seq=1),
            ts[1].recv(0, got_small, seq=1),
        )
        assert got_big.sum() == big.size and got_small.sum() == small.size
        assert set(lane_bytes(ts[0], 1)) == {0}
    finally:
        await asyncio.gather(*(t.close() for t in ts))


@pytest.mark.usefixtures("distinct_hosts")
async def test_different_lane_counts_fail_on_every_rank() -> None:
    store = HashStore()
    one = Advertised(("127.0.0.1",), ("lo",), True, "test")
    ts = list(
        await asyncio.gather(
            *(Transport.start(store, r, 3, token="job", timeout=5, advertise=a) for r, a in enumerate([two_lanes(), one, one]))
        )
    )
    try:
        results = await asyncio.gather(*(t.exchange(5) for t in ts), return_exceptions=True)
        for r in results:
            assert isinstance(r, DistNetworkError), r
            msg = str(r)
            assert "different numbers of network interfaces" in msg
            assert "1 (['lo']): ranks [1, 2]" in msg and "2 (['lo', 'lo:1']): ranks [0]" in msg
    finally:
        await asyncio.gather(*(t.close() for t in ts))


async def test_exchange_names_the_ranks_that_never_published() -> None:
    t = await Transport.start(HashStore(), 0, 3, token="job", timeout=5)
    try:
        with pytest.raises(DistTimeoutError, match=r"timeout after 0.2 s waiting for the transport addresses of ranks \[1, 2\]"):
            await t.exchange(0.2)
    finally:
        await t.close()


# -- connection failures, visible ----------------------------------------------------------------


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()  # nobody listens there now: connects are refused
    return port


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.5 s a run); a second loop waits them out again for the same result")
async def test_a_peer_that_cannot_be_reached_is_warned_about_and_named(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dialer_mod, "_WARN_AFTER_S", 0.3)
    monkeypatch.setattr(dialer_mod, "_WARN_EVERY_S", 0.4)
    store = HashStore()
    port = closed_port()
    await store.set(address_key(1), PeerAddress(1, "127.0.0.1", port, None, "another-host").encode())
    t = await Transport.start(store, 0, 2, token="job", timeout=1.5)
    caplog.set_level(logging.WARNING, logger="aiodist.transport")
    try:
        with pytest.raises(DistTimeoutError) as e:
            await t.send(1, np.ones(4), seq=3)
        msg = str(e.value)
        assert f"no connection to rank 1 at 127.0.0.1:{port} was ever made (last error: " in msg
        assert "Connect call failed" in msg or "refused" in msg.lower()
        assert t.connection_report([1, 0]) == msg[msg.index("; no connection") :]
        warnings = [r.getMessage() for r in caplog.records if "cannot connect to rank 1" in r.getMessage()]
        assert 1 <= len(warnings) <= 5, warnings  # rate-limited, not one per retry
        assert f"127.0.0.1:{port}" in warnings[0]
    finally:
        await t.close()


async def test_no_report_once_a_connection_was_made() -> None:
    store = HashStore()
    ts = list(await asyncio.gather(*(Transport.start(store, r, 2, token="job", timeout=5) for r in range(2))))
    try:
        got = np.zeros(4)
        await asyncio.gather(ts[0].send(1, np.ones(4)), ts[1].recv(0, got))
        assert ts[0].connection_report([1]) == "" and ts[1].connection_report([0]) == ""
    finally:
        await asyncio.gather(*(t.close() for t in ts))


def test_stats_show_the_advertised_address() -> None:
    async def main() -> dict[str, Any]:
        t = await Transport.start(HashStore(), 0, 1, token="job", timeout=5, advertise=Advertised(("127.0.0.1",), (), False, "because"))
        try:
            return t.stats()
        finally:
            await t.close()

    st_ = asyncio.run(main())
    assert st_["address"].startswith("127.0.0.1:") and st_["lanes"] == ["127.0.0.1"] and st_["advertised_because"] == "because"


@pytest.mark.parametrize(
    ("host", "port", "text"),
    [("10.0.0.1", 29500, "10.0.0.1:29500"), ("fd00::1", 7, "[fd00::1]:7"), ("[fd00::1]", 7, "[fd00::1]:7"), ("node-a", 1, "node-a:1")],
)
def test_launcher_endpoints_round_trip_ipv6(host: str, port: int, text: str) -> None:
    # aiodist-run --master-addr fd00::1 once became 'fd00::1:29500', which does not parse
    from aiodist.launcher.rendezvous import format_endpoint, parse_endpoint

    assert format_endpoint(host, port) == text
    assert parse_endpoint(text, 0) == (host.strip("[]"), port)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.7 s a run); a second loop waits them out again for the same result")
async def test_a_group_timeout_says_no_connection_was_ever_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer whose published address refuses by the time it is dialed (a rank behind a
    firewall, a wrong --local-addr; here: a rank whose listener closed after init): the
    all_reduce's timeout names the address and the OS error. Shared memory off: the socket path
    is what dials (rank 1 here is a bare transport, with no shared memory of its own)."""
    import aiodist as dist

    monkeypatch.setenv("AIODIST_SHM_BYTES", "0")

    store = PrefixStore("default", HashStore())

    async def rank1() -> Transport:
        t = await Transport.start(store, 1, 2, token="job", timeout=5)
        await t.exchange(5)
        return t

    with dist.use_world(dist.World("never-connected")):
        _, t1 = await asyncio.gather(dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=1.5), rank1())
        assert t1.address is not None
        port = t1.address.port
        await t1.close()  # nobody listens there now: rank 0's connects are refused
        try:
            with pytest.raises(DistTimeoutError) as e:
                await dist.all_reduce(np.ones(4))
            msg = str(e.value)
            assert "all_reduce" in msg and "seq 0" in msg and "ranks not heard from: [1]" in msg
            assert "no connection to rank 1 at " in msg and f":{port} was ever made (last error: " in msg
        finally:
            await dist.destroy_process_group()


@pytest.mark.usefixtures("distinct_hosts")
async def test_small_split_sizes_never_take_the_nowait_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # send_nowait sends up to 64 KiB at once, unsplit: with AIODIST_STRIPE_MIN_BYTES below that
    # its receiver would wait for parts that never come
    monkeypatch.setenv("AIODIST_STRIPE_MIN_BYTES", "4096")
    store = HashStore()
    ts = await start(2, store, [two_lanes(), two_lanes()], timeout=5)
    try:
        got = np.zeros(8)
        await asyncio.gather(ts[0].send(1, np.ones(8), seq=1), ts[1].recv(0, got, seq=1))  # connected now
        assert ts[0].send_nowait(1, np.ones(1024), seq=2) is False  # 8 KiB: would be split
        assert ts[0].send_nowait(1, np.ones(8), seq=2) is not False
        big = np.zeros(1024)
        await asyncio.gather(ts[0].send(1, np.ones(1024), seq=3), ts[1].recv(0, big, seq=3), ts[1].recv(0, got, seq=2))
        assert big.sum() == 1024 and got.sum() == 8
    finally:
        await asyncio.gather(*(t.close() for t in ts))


@pytest.mark.usefixtures("distinct_hosts")
async def test_different_split_sizes_fail_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    store = HashStore()
    ts = []
    for r, size in enumerate(["262144", "1048576"]):
        monkeypatch.setenv("AIODIST_STRIPE_MIN_BYTES", size)
        ts.append(await Transport.start(store, r, 2, token="job", timeout=5, advertise=two_lanes()))
    try:
        results = await asyncio.gather(*(t.exchange(5) for t in ts), return_exceptions=True)
        for res in results:
            assert isinstance(res, DistNetworkError), res
            assert "different sizes (AIODIST_STRIPE_MIN_BYTES): 262144 bytes: ranks [0]; 1048576 bytes: ranks [1]" in str(res)
    finally:
        await asyncio.gather(*(t.close() for t in ts))


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.5 s a run); a second loop waits them out again for the same result")
@pytest.mark.usefixtures("distinct_hosts")
async def test_a_lane_that_never_connects_is_named() -> None:
    # the commonest multi-NIC mistake: a second interface that does not route between the hosts
    store = HashStore()
    bad = Advertised(("127.0.0.1", "192.0.2.1"), ("lo", "bad0"), True, "test")
    ts = await start(2, store, [two_lanes(), bad], timeout=1.5)
    try:
        recv = asyncio.ensure_future(ts[1].recv(0, np.zeros(1 << 17), seq=1))
        with pytest.raises(DistTimeoutError) as e:
            await ts[0].send(1, np.ones(1 << 17), seq=1)
        recv.cancel()
        with contextlib.suppress(asyncio.CancelledError, DistTimeoutError):
            await recv
        msg = str(e.value)
        assert ts[1].address is not None
        assert f"no connection to rank 1 on lane 1 (lo:1) at 192.0.2.1:{ts[1].address.port} was ever made (last error: " in msg, msg
    finally:
        await asyncio.gather(*(t.close() for t in ts))


@pytest.mark.usefixtures("distinct_hosts")
async def test_a_send_uses_the_peers_connection_when_its_own_dial_cannot_get_through() -> None:
    # one-way reachability (a firewall, a wrong --local-addr): rank 1's advertised address is
    # unreachable, but rank 1 reaches rank 0; rank 0's send then goes over that connection
    store = HashStore()
    unreachable = Advertised(("192.0.2.1",), (), False, "test")
    ts = await start(2, store, [Advertised(("127.0.0.1",), (), False, "test"), unreachable], timeout=10)
    try:
        send = asyncio.ensure_future(ts[0].send(1, np.full(4, 7.0), seq=1))
        await asyncio.sleep(0.2)  # rank 0 is dialing 192.0.2.1 and failing
        assert not send.done()
        got, back = np.zeros(4), np.zeros(4)
        await asyncio.wait_for(asyncio.gather(ts[1].send(0, np.ones(4), seq=2), ts[0].recv(1, back, seq=2)), 5)
        await asyncio.wait_for(asyncio.gather(send, ts[1].recv(0, got, seq=1)), 2)  # not the 10 s timeout
        assert got.sum() == 28 and back.sum() == 4
    finally:
        await asyncio.gather(*(t.close() for t in ts))


async def test_close_while_a_dial_is_in_its_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    # close() cancels dials in flight; one in its handshake must not take the connection's
    # handshake future with it (say_goodbye then read a cancelled future's exception and close
    # raised CancelledError: seen once a send could go out before its own dial had finished)
    from aiodist.errors import DistError
    from aiodist.testing import until
    from aiodist.transport import _connection as connection_mod

    monkeypatch.setattr(connection_mod, "hello_frame", lambda hello, lane=0: b"")  # no HELLO: handshakes never end
    store = HashStore()
    ts = list(await asyncio.gather(*(Transport.start(store, r, 2, token="job", timeout=5, unix=False) for r in range(2))))
    send = asyncio.ensure_future(ts[0].send(1, np.ones(2)))
    await until(lambda: any(c.dialed_peer == 1 for c in ts[0]._conns), "rank 0 dialed rank 1")
    await ts[0].close()
    await ts[1].close()
    with pytest.raises(DistError):
        await send


@pytest.mark.usefixtures("distinct_hosts")
async def test_an_any_source_receive_of_a_message_that_would_be_split_is_refused() -> None:
    store = HashStore()
    ts = await start(2, store, [two_lanes(), two_lanes()], timeout=5)
    try:
        with pytest.raises(ValueError, match="any-source receive of a 1048576-byte collective message"):
            await ts[1].recv(None, np.zeros(1 << 17), seq=4)
        small = np.zeros(4)  # small ones, and user p2p of any size, are never split: allowed
        await asyncio.gather(ts[0].send(1, np.ones(4), seq=4), ts[1].recv(None, small, seq=4))
        big = np.zeros(1 << 17)
        await asyncio.gather(ts[0].send(1, np.ones(1 << 17), seq=P2P_SEQ), ts[1].recv(None, big, seq=P2P_SEQ))
        assert small.sum() == 4 and big.sum() == 1 << 17
    finally:
        await asyncio.gather(*(t.close() for t in ts))
