"""The transport's standing (aiodist/transport/_standing.py), sans-I/O: lost peers and broken
groups are recorded once (the first reason stays), and an op meets a broken group before a
lost peer, with the errors' sentences and culprits."""

from __future__ import annotations

import pytest

from aiodist.errors import DistBackendError, DistNetworkError
from aiodist.transport._standing import Standing


def test_the_first_loss_and_the_first_break_stay() -> None:
    s = Standing()
    first = DistNetworkError("rank 0: rank 1 closed the connection without GOODBYE", culprits={1: "lost"})
    assert s.lose(1, first) is True
    assert s.lose(1, DistNetworkError("later")) is False  # said once per peer
    assert s.break_group(3, "rank 0 broke group 3: desync detected") is True
    assert s.break_group(3, "another reason") is False
    s.blame(3, {2: "called broadcast at seq 1"})
    s.blame(3, {4: "later"})
    assert s.dead_error(1).args == first.args and s.dead_error(1).culprits == {1: "lost"}
    e = s.abort_error(3)
    assert str(e) == "rank 0 broke group 3: desync detected" and e.culprits == {2: "called broadcast at seq 1"}


@pytest.mark.parametrize(
    ("group", "peer", "raises"),
    [
        (0, 5, None),  # a live group and peer: nothing
        (0, None, None),
        (3, 5, DistBackendError),  # a broken group, whoever the peer
        (3, 1, DistBackendError),  # the group's break comes before the peer's loss
        (0, 1, DistNetworkError),  # a lost peer in a live group
    ],
)
def test_check_as_a_table(group: int, peer: int | None, raises: type[Exception] | None) -> None:
    s = Standing()
    s.lose(1, DistNetworkError("rank 1 is gone"))
    s.break_group(3, "group 3 broke")
    if raises is None:
        s.check(group, peer)
    else:
        with pytest.raises(raises):
            s.check(group, peer)


@pytest.mark.parametrize(
    ("closed", "group", "peer", "says"),
    [
        (False, 0, 5, None),  # alive: nothing
        (True, 0, 5, "rank 0: the transport is closed (group 0, seq 7, tag 0)"),  # closed comes first
        (True, 3, 1, "rank 0: the transport is closed (group 3, seq 7, tag 0)"),
        (False, 3, 1, "group 3 broke"),  # then a broken group
        (False, 0, 1, "rank 1 is gone"),  # then a lost peer
        (False, 0, None, None),
    ],
)
def test_usable_as_a_table(closed: bool, group: int, peer: int | None, says: str | None) -> None:
    """What ``Transport.check_peer`` answers the runner and shared memory: a closed transport,
    then a broken group, then a lost peer."""
    s = Standing(0)
    s.lose(1, DistNetworkError("rank 1 is gone"))
    s.break_group(3, "group 3 broke")
    s.closed = closed
    if says is None:
        s.usable((group, 7, 0), peer)
    else:
        with pytest.raises((DistBackendError, DistNetworkError)) as info:
            s.usable((group, 7, 0), peer)
        assert str(info.value) == says
