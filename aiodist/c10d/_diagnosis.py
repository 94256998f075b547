"""The timeout diagnosis: what a rank whose collective timed out writes through the store, what
it reads back from the ranks it waits on, and the sentence that names the culprit first. Cold
and self-contained: the op runner (``aiodist.c10d._runner``) calls it only when an op's deadline
fires.

Rules:
- Reading is an effect (``consult``); naming is a pure function of what was read (``explain``,
  ``culprits_of``), tested as tables.
- A rank writes its report (``aiodist/hang/<group>/<seq>/<rank>``: the op, whom it waits on,
  when it last heard each peer) before its note (``aiodist/hang/rank/<rank>``: one line per op
  of that rank that timed out, any group), so a note of this op means its report is there.
- A rank with no report is looked for in its notes (an op elsewhere: where it is), but its
  report is still waited for until the polling ends: a rank with several ops in flight notes
  each as its deadlines fire, another op's note may come first.
- A store that does not answer within the grace is said to, and no rank is blamed by inference;
  a rank whose own deadline fired late (stopped, blocked) blames nobody for the peers' silence.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiodist._time import Deadline
from aiodist.c10d._blocked import BLOCKED_KEY
from aiodist.c10d._blocked import describe as describe_block
from aiodist.errors import DistError
from aiodist.store.base import Store

__all__ = [
    "DETAIL_HINT",
    "NOTES",
    "LATE_S",
    "Report",
    "Note",
    "Findings",
    "explain",
    "culprits_of",
    "consult",
    "did_not_run",
    "grace_for",
    "note_only",
]

log = logging.getLogger("aiodist.c10d")

#: the end of a timeout message whose diagnosis DETAIL would have taken further
DETAIL_HINT = "; rerun with AIODIST_DEBUG=DETAIL to compare every rank's call before it runs"
#: ``NOTES + str(rank)``: one JSON line per op of that rank that timed out, in any group
NOTES = "aiodist/hang/rank/"
_POLL_S = 0.02
#: a deadline that fires this much later than due says this rank's own loop did not run meanwhile
#: (the process stopped, e.g. SIGSTOP or a debugger, or the loop blocked): a healthy loop fires
#: its timers within milliseconds, a loaded 2-core machine within a few tenths
LATE_S = 0.5


# -- what ranks write through the store at a timeout, and what is read back ---------------------


@dataclass(frozen=True)
class Report:
    """What a timed-out rank writes under ``aiodist/hang/<group id>/<seq>/<rank>``: the op it
    issued at that seq, whom its receives wait on, and when it last heard from each peer."""

    op: str
    waits: tuple[int, ...]
    heard: dict[int, float] = field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps({"op": self.op, "waits": list(self.waits), "heard": {str(r): t for r, t in self.heard.items()}})

    @staticmethod
    def decode(raw: bytes) -> Report:
        d = json.loads(raw)
        return Report(str(d["op"]), tuple(int(r) for r in d["waits"]), {int(r): float(t) for r, t in d.get("heard", {}).items()})


@dataclass(frozen=True)
class Note:
    """One line of ``aiodist/hang/rank/<rank>``: an op of that rank that timed out, in any group
    (point-to-point too), so a rank missing from one op can be found in another."""

    group: int
    label: str  # "seq 3", "p2p seq 0 (tag 1, peers [1])"
    op: str
    t: float  # time.time() when it was written
    seq: int | None = None  # a collective's seq (its report is under aiodist/hang/<group>/<seq>/); None for p2p

    def encode(self) -> str:
        return json.dumps({"group": self.group, "label": self.label, "op": self.op, "t": self.t, "seq": self.seq})

    @staticmethod
    def decode_lines(raw: bytes) -> list[Note]:
        out = []
        for line in raw.decode().splitlines():
            if line.strip():
                d = json.loads(line)
                seq = d.get("seq")
                out.append(Note(int(d["group"]), str(d["label"]), str(d["op"]), float(d["t"]), None if seq is None else int(seq)))
        return out

    def where(self) -> str:
        return f"{self.op} {self.label} of group {self.group}"


@dataclass
class Findings:
    """What one rank learnt through the store in its grace."""

    reports: dict[int, Report]  # this rank's own included
    notes: dict[int, list[Note]] = field(default_factory=dict)  # ranks without a report here, seen timing out elsewhere
    answered: bool = True  # False: the store did not answer every request in time
    blocked: dict[int, str] = field(default_factory=dict)  # ranks whose loop watchdog says their loop is blocked
    #: ranks found in another op (another seq of this group, or an op of another group): whom they
    #: wait on there, and where those waits end (the ranks there with no report, or waiting on nobody)
    beyond: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    store_host: str | None = None  # whose process serves the store ("rank 0"), if known: named when it does not answer


@dataclass
class _Walk:
    """The waits followed from this rank: where each chain ends."""

    mismatched: dict[str, list[int]] = field(default_factory=dict)  # op name -> ranks that issued it at this seq instead
    missing: list[int] = field(default_factory=list)  # waited on, no report
    idle: list[int] = field(default_factory=list)  # waited on, reported, waiting on nobody
    followed: list[int] = field(default_factory=list)  # reported the same op, waiting on someone


def _walk(me: int, op: str, reports: dict[int, Report]) -> _Walk:
    w = _Walk()
    seen = {me}
    frontier = list(reports[me].waits)
    while frontier:
        r = frontier.pop(0)
        if r in seen:
            continue
        seen.add(r)
        rep = reports.get(r)
        if rep is None:
            w.missing.append(r)
        elif rep.op != op:
            w.mismatched.setdefault(rep.op, []).append(r)
        elif not rep.waits:
            w.idle.append(r)
        else:
            w.followed.append(r)
            frontier.extend(rep.waits)
    w.missing.sort()
    w.idle.sort()
    return w


def _ranks(rs: Sequence[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {sorted(rs)}"


def did_not_run(me: int, late: float) -> str:
    """The headline's clause for a deadline that fired ``late`` s after it was due."""
    return (
        f"rank {me} itself did not run for {late:.1f} s past its deadline (its timer fired late: this process was "
        "stopped, e.g. by SIGSTOP or a debugger, or its event loop was blocked)"
    )


def explain(
    me: int, op: str, seq: int, group_id: int, found: Findings, *, since: float, now: float, grace: float, late: float = 0.0
) -> tuple[str, str, bool]:
    """``(headline, tail, hint)`` of a timed-out collective from what the store gave: the
    headline names the culprit and what it did (empty if nothing is known), the tail keeps the
    waits seen and the ranks by kind, ``hint`` says whether DETAIL would have told more.
    ``since`` is when this rank's op started (``time.time()``), ``now`` when it gave up, ``late``
    how long after it was due this rank's deadline fired (``LATE_S`` or more: this rank itself
    did not run, which leads the headline, and a peer's silence blames nobody: the peers gave up
    on this rank meanwhile, and may have left without a word)."""
    walk = _walk(me, op, found.reports)
    heard: dict[int, float] = {}
    for rep in found.reports.values():
        for r, t in rep.heard.items():
            heard[r] = max(t, heard.get(r, t))
    head: list[str] = []
    hint = False
    frozen = late >= LATE_S
    if frozen:
        head.append(did_not_run(me, late) + ", so the peers' silence blames nobody")
    if not found.answered:
        host = f"the store's host, {found.store_host}," if found.store_host else "the store's host"
        if frozen:  # the store's host most likely gave up on this rank and left
            head.append(f"the store did not answer within {grace:g} s ({host} may have left meanwhile)")
        else:
            head.append(f"the store did not answer within {grace:g} s, so no rank is named as the cause (is {host} stopped?)")
        hint = True
    if walk.mismatched:
        hint = True
        parts = [f"{_ranks(rs)} issued {other} at seq {seq}" for other, rs in sorted(walk.mismatched.items())]
        head.append(", ".join(parts) + f", not {op}")
    for r in walk.missing:  # the rank's own watchdog said so: no inference needed
        if r in found.blocked:
            head.append(found.blocked[r])
    missing = [r for r in walk.missing if r not in found.blocked]
    elsewhere = [r for r in missing if r in found.notes]
    in_op = [r for r in missing if r not in found.notes and r in heard]
    absent = [r for r in missing if r not in found.notes and r not in heard]
    if found.answered:
        for r in elsewhere:
            # the chain goes on at that op: whom the rank waits on there (a rank stopped mid-loop
            # leaves its next peer one op behind, and that peer's wait names the stopped one)
            waits, ends = found.beyond.get(r, ([], []))
            on = f", waiting on {_ranks(waits)} there" if waits else ""
            if ends and set(ends) != set(waits):
                on += f" (and through them on {_ranks(ends)})"
            head.append(f"rank {r} never issued {op} seq {seq} of group {group_id}: it is in {found.notes[r][-1].where()}{on}")
        if absent and not frozen:
            head.append(
                f"{_ranks(absent)} never issued {op} seq {seq} of group {group_id} "
                "(or stopped before sending anything: no report and no message from it in this op)"
            )
    for r in in_op:  # evidence from messages, not an inference from silence
        head.append(f"rank {r} is in the op but sent nothing for {now - heard[r]:.1f} s (stopped or overloaded)")
    if found.answered:
        for r in walk.idle:
            head.append(
                f"rank {r} is in the op but sent nothing for {now - heard.get(r, since):.1f} s (it waits on no peer: overloaded, or a message was lost)"
            )
        if not head and walk.followed:
            head.append(
                f"{_ranks(sorted({me, *walk.followed}))} wait on each other in this op (none is outside it: a lost message, or calls that differ)"
            )
            hint = True
    chain = ", ".join(
        f"rank {r} on {list(rep.waits)}" for r, rep in sorted(found.reports.items()) if r != me and rep.op == op and rep.waits
    )
    tail = f"; waits seen through the store: {chain}" if chain else ""
    if found.answered and not frozen and (elsewhere or absent):
        tail += f"; ranks stuck outside this op (never reported being in it): {sorted(elsewhere + absent)}"
    if in_op:
        tail += f"; ranks in this op but silent (no report, earlier messages seen): {in_op}"
    return "; ".join(head), tail, hint


def culprits_of(me: int, op: str, seq: int, found: Findings) -> dict[int, str]:
    """The ranks ``explain`` blames, each with what it did (an error's ``culprits`` field):
    another op at this seq, a blocked loop, never issued this op (or, for a rank found waiting
    in another op, the ranks where that wait's chain ends), in it but silent."""
    walk = _walk(me, op, found.reports)
    out: dict[int, str] = {}
    for other, rs in walk.mismatched.items():
        for r in rs:
            out[r] = f"issued {other} at seq {seq}"
    heard = {r for rep in found.reports.values() for r in rep.heard}
    for r in walk.missing:
        if r in found.blocked:
            out[r] = "its event loop is blocked"
        elif r in found.notes:
            where = found.notes[r][-1].where()
            # where the chain that rank waits on there ends (a rank stopped mid-loop leaves its
            # next peer one op behind, waiting on it, in this group or another): those are
            # blamed, not the waiting rank
            waits, ends = found.beyond.get(r, ([], []))
            further = [q for q in (ends or waits) if q not in (me, r)]
            for q in further:
                out.setdefault(q, f"holds up {where}: rank {r} waits on it there, so never issued {op} seq {seq}")
            if not further:
                out[r] = f"never issued {op} seq {seq}: it is in {where}"
        elif r in heard:
            out[r] = f"in {op} seq {seq} but sent nothing"
        elif found.answered:
            out[r] = f"never issued {op} seq {seq}"
    for r in walk.idle:
        out.setdefault(r, f"in {op} seq {seq} but sent nothing, waiting on nobody")
    return out


async def consult(store: Store, group_id: int, seq: int, me: int, mine: Report, note: Note, grace: float, *, since: float) -> Findings:
    """Write this rank's report and note, then read the reports of the ranks it waits on (and
    theirs) for most of ``grace`` seconds; a rank with no report here is looked for in the notes
    of ops it timed out in since ``since``, and its report still waited for until the polling
    ends (its note of another op it had in flight may come first). ``answered`` is False when
    some store call did not return within ``grace``, or failed."""
    prefix = f"aiodist/hang/{group_id}/{seq}/"
    found = Findings({me: mine}, store_host=_served_by(store))
    loop = asyncio.get_running_loop()
    stop = loop.time() + grace * 0.75  # the rest is the margin a slow answer may take

    def unknown() -> list[int]:
        return _walk(me, mine.op, found.reports).missing

    passes = 0
    try:
        async with Deadline(grace):
            await store.set(prefix + str(me), mine.encode())
            await store.append(NOTES + str(me), note.encode() + "\n")
            while True:
                for r in unknown():
                    if r not in found.blocked and await store.check([BLOCKED_KEY + str(r)]):
                        said = describe_block(r, await store.get(BLOCKED_KEY + str(r)))
                        if said is not None:
                            found.blocked[r] = said
                    if await store.check([prefix + str(r)]):
                        found.reports[r] = Report.decode(await store.get(prefix + str(r)))
                        found.notes.pop(r, None)  # (its notes of other ops: it is in this one too)
                        found.beyond.pop(r, None)
                    elif r not in found.notes and await store.check([NOTES + str(r)]):
                        # (read once: a later timeout of this op writes its report first)
                        fresh = [n for n in Note.decode_lines(await store.get(NOTES + str(r))) if n.t >= since]
                        if any(n.group == group_id and n.seq == seq for n in fresh):
                            # a note of this very op: it wrote its report just before (after this
                            # pass looked for it), so the report is there, with its waits
                            found.reports[r] = Report.decode(await store.get(prefix + str(r)))
                            found.notes.pop(r, None)
                            found.beyond.pop(r, None)
                        elif fresh:
                            # timed out elsewhere: where it is, unless its report of this op
                            # comes before the polling ends (a rank with several ops in flight
                            # notes each, in the order their deadlines fired)
                            found.notes[r] = fresh
                            last = fresh[-1]
                            there = f"aiodist/hang/{last.group}/{last.seq}/{r}"
                            if last.seq is not None and (last.group, last.seq) != (group_id, seq) and await store.check([there]):
                                found.beyond[r] = await _chase(store, last.group, last.seq, r, Report.decode(await store.get(there)))
                passes += 1
                if not unknown() or loop.time() + _POLL_S >= stop:
                    break
                await asyncio.sleep(_POLL_S)
    except (TimeoutError, DistError, ValueError, KeyError) as exc:  # the deadline, the store's own, a bad value
        log.debug("rank %d: consulting the store on seq %d of group %d: %r", me, seq, group_id, exc)
        # the store answered when one whole pass over the ranks came back: a later pass that the
        # deadline cut short (a frozen rank never reports, so the polling runs to the end) keeps
        # what was read (a loaded machine's last pass often ran past the grace: CI hit it)
        found.answered = passes > 0 and isinstance(exc, TimeoutError)
    return found


async def _chase(store: Store, group_id: int, seq: int, r: int, rep: Report) -> tuple[list[int], list[int]]:
    """Whom rank ``r`` waits on at ``seq`` (its report there is ``rep``), and where those waits end
    at that seq: the ranks with no report there or waiting on nobody (bounded by the caller's deadline)."""
    waits = [w for w in rep.waits if w != r]
    seen, ends, frontier = {r}, [], list(waits)
    while frontier:
        w = frontier.pop(0)
        if w in seen:
            continue
        seen.add(w)
        key = f"aiodist/hang/{group_id}/{seq}/{w}"
        theirs = Report.decode(await store.get(key)) if await store.check([key]) else None
        if theirs is None or not theirs.waits:
            ends.append(w)
        else:
            frontier.extend(theirs.waits)
    return waits, sorted(ends)


def _served_by(store: Store) -> str | None:
    """Whose process serves ``store`` (a TCPStore made by the rendezvous knows), through prefixes."""
    while True:
        inner = getattr(store, "underlying_store", None)
        if not isinstance(inner, Store):
            break
        store = inner
    by = getattr(store, "served_by", None)
    return by if isinstance(by, str) else None


async def note_only(store: Store, me: int, note: Note, grace: float) -> None:
    """A point-to-point op's timeout: leave the note, so the ranks that wait on this rank in a
    collective find where it is."""
    try:
        async with Deadline(grace):
            await store.append(NOTES + str(me), note.encode() + "\n")
    except (TimeoutError, DistError) as exc:
        log.debug("rank %d: noting a timeout in the store: %r", me, exc)


def grace_for(limit: float) -> float:
    """The part of an op's time kept to consult the store on a timeout: 10 %, at least 50 ms,
    at most 5 s, and never more than half the op's time (a 50 ms timeout kept 50 ms and left the
    op none: it timed out at once)."""
    return min(max(limit * 0.1, 0.05), 5.0, limit / 2)
