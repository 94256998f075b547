"""What every rank must agree on per collective op, and the verdict on a peer's frame: sans-I/O.

A collective op's frames carry the digest of what every rank must agree on for it (the op and
its arguments, aiodist._digest). ``DigestBook`` keeps, per (group, seq):

- this rank's record of the op (``record``): its digest, its call (op name, arguments, group
  description) and the group's size, for the sentence when a peer's digest differs; the last
  ``kept`` ops of a group are kept (an op that old is over) and a destroyed group's go
  (``release``);
- a peer's digest that arrived before this rank issued the op (``own`` answers None then and
  keeps the frame's digest, a bounded number of them), checked when the op is recorded: a
  mismatch is returned by ``record``.

``mismatch`` gives the sentence both sides of a mismatch get and the culprit (the peer, what it
called) an error's ``culprits`` names. The transport acts on them (it breaks the group on every
rank); this module does no I/O, and is tested as a table (tests/test_transport_digests.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from aiodist._digest import describe_mismatch, mismatch_culprit

__all__ = ["DigestBook", "Early", "Mine"]


class Mine(NamedTuple):
    """This rank's record of one op."""

    digest: int
    op: str
    args: Any
    group_desc: str | None
    size: int


class Early(NamedTuple):
    """A peer's frame of an op this rank had not issued yet: its digest, source and length."""

    digest: int
    source: int
    nbytes: int


class DigestBook:
    """The digests of one rank's collective ops (the module docstring)."""

    __slots__ = ("kept", "_mine", "_early")

    def __init__(self, kept: int = 4096) -> None:
        self.kept = kept
        self._mine: dict[tuple[int, int], Mine] = {}
        self._early: dict[tuple[int, int], Early] = {}

    def record(self, group: int, seq: int, digest: int, call: tuple[str, Any, str | None] | None, size: int) -> Early | None:
        """This rank issues op ``seq`` of ``group``: keep its record, forget the group's op
        ``kept`` seqs older; a peer's frame that came first with another digest is returned
        (a desync), else None."""
        k = (group, seq)
        op, args, desc = call or ("an op", None, None)
        self._mine[k] = Mine(digest, op, args, desc, size)
        self._mine.pop((group, seq - self.kept), None)
        early = self._early.pop(k, None)
        return early if early is not None and early.digest != digest else None

    def own(self, group: int, seq: int, digest: int, source: int, nbytes: int) -> int | None:
        """This rank's digest for the op of a peer's frame (to compare with the frame's); None
        before this rank issued the op: the frame's digest is then kept (up to ``kept`` such)."""
        mine = self._mine.get((group, seq))
        if mine is None:
            if len(self._early) < self.kept:
                self._early.setdefault((group, seq), Early(digest, source, nbytes))
            return None
        return mine.digest

    def mine(self, group: int, seq: int) -> Mine | None:
        return self._mine.get((group, seq))

    def op_name(self, group: int, seq: int) -> str | None:
        mine = self._mine.get((group, seq))
        return None if mine is None else mine.op

    def release(self, group: int) -> None:
        """Group ``group`` is destroyed here: forget its records and its early frames."""
        for table in (self._mine, self._early):
            for k in [k for k in table if k[0] == group]:
                del table[k]

    def mismatch(self, me: int, group: int, seq: int, peer: int, theirs: int, nbytes: int = -1) -> tuple[str, dict[int, str]] | None:
        """The sentence for peer ``peer``'s digest ``theirs`` for op ``seq`` of ``group`` (a
        message of ``nbytes`` from it, -1: none seen) and the culprits; None where this rank
        kept no record of the op."""
        mine = self._mine.get((group, seq))
        if mine is None:
            return None
        name = f"group {group}" if mine.group_desc is None else f"group {group} ({mine.group_desc!r})"
        call = (mine.digest, mine.op, mine.args)
        return describe_mismatch(name, seq, me, call, peer, theirs, nbytes, mine.size), {peer: mismatch_culprit(seq, call, theirs)}

    def __len__(self) -> int:
        return len(self._mine) + len(self._early)
