"""The handshake's verdict (aiodist/transport/_handshake.py ``refusal``) as a table, pure: why a
peer's HELLO is refused, in the order the checks run."""

from __future__ import annotations

import pytest

from aiodist.transport._handshake import refusal
from aiodist.wire.frame import Hello

MINE = Hello(b"job", 0, 4)


@pytest.mark.parametrize(
    ("hello", "dialed", "closed", "says"),
    [
        (Hello(b"job", 2, 4), None, False, None),  # accepted, a rank of this job
        (Hello(b"job", 2, 4), 2, False, None),  # dialed, the rank dialed answered
        (Hello(b"other", 2, 4), None, False, "rank 2 of another job (job token mismatch)"),
        (Hello(b"other", 2, 8), 3, True, "rank 2 of another job"),  # the token first
        (Hello(b"job", 2, 8), None, False, "rank 2 says the world size is 8, here it is 4"),
        (Hello(b"job", 2, 4), 3, False, "dialed rank 3, but rank 2 answered (stale address in the store?)"),
        (Hello(b"job", 0, 4), None, False, "a connection from this rank (0) itself"),
        (Hello(b"job", 2, 4), None, True, "this transport is closed"),  # the last check
    ],
)
def test_refusal_as_a_table(hello: Hello, dialed: int | None, closed: bool, says: str | None) -> None:
    why = refusal(MINE, hello, dialed, closed)
    assert why == says if says is None else why is not None and why.startswith(says)
