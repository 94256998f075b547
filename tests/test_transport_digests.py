"""The transport's digest book (aiodist/transport/_digests.py), sans-I/O, as a table: what a
peer's frame is compared with, early frames kept and checked when the op is recorded, old ops
and destroyed groups forgotten, and the sentence and culprit of a mismatch."""

from __future__ import annotations

from typing import Any

import pytest

from aiodist._digest import op_digest
from aiodist.transport._digests import DigestBook, Early

A = op_digest("all_reduce", {"tensor": "float32[4]", "op": "SUM"})
B = op_digest("broadcast", {"tensor": "float32[4]", "root": 0})
CALL_A: tuple[str, Any, str | None] = ("all_reduce", {"tensor": "float32[4]", "op": "SUM"}, "default_pg")


@pytest.mark.parametrize(
    ("steps", "want"),
    [
        # (what happens, in order) -> what the last step answers
        ([("own", 0, 1, A)], None),  # a frame before the op: kept, nothing to compare yet
        ([("own", 0, 1, A), ("record", 0, 1, A)], None),  # the same digest came first: no desync
        ([("own", 0, 1, B), ("record", 0, 1, A)], Early(B, 1, 16)),  # another digest came first: the desync
        ([("record", 0, 1, A), ("own", 0, 1, B)], A),  # after the op: this rank's digest, to compare
        ([("record", 0, 1, A), ("release", 0, 0, 0), ("own", 0, 1, B)], None),  # a destroyed group's ops are gone
        ([("record", 7, 1, A), ("release", 0, 0, 0), ("own", 7, 1, B)], A),  # another group's stay
    ],
)
def test_the_book_as_a_table(steps: list[tuple[str, int, int, int]], want: object) -> None:
    book = DigestBook(kept=8)
    got: object = None
    for what, group, seq, digest in steps:
        if what == "own":
            got = book.own(group, seq, digest, 1, 16)
        elif what == "record":
            got = book.record(group, seq, digest, CALL_A, 2)
        else:
            book.release(group)
    assert got == want


def test_old_ops_and_early_frames_are_bounded() -> None:
    book = DigestBook(kept=4)
    for seq in range(10):
        book.record(0, seq, A, CALL_A, 2)
    assert book.mine(0, 5) is None and book.mine(0, 6) is not None  # an op kept-seqs old is over
    for seq in range(100, 120):
        assert book.own(1, seq, B, 1, 16) is None
    assert len(book) <= 4 + 4  # at most kept early frames, whatever peers send


def test_a_mismatch_names_both_calls_and_the_culprit() -> None:
    book = DigestBook()
    assert book.mismatch(0, 0, 3, 1, B) is None  # no record of the op: nothing to say
    book.record(0, 3, A, CALL_A, 2)
    found = book.mismatch(0, 0, 3, 1, B)
    assert found is not None
    sentence, culprits = found
    assert sentence.startswith("desync detected: seq 3 on group 0 ('default_pg'): rank 1 called broadcast, rank 0 called all_reduce")
    assert culprits == {1: "called broadcast at seq 3"}
    assert book.op_name(0, 3) == "all_reduce" and book.op_name(0, 4) is None
