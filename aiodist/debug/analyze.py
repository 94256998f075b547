"""Read every rank's flight-recorder dump and say where the ranks parted ways.

    python -m aiodist.debug.analyze DIR [--json]

``DIR`` holds ``aiodist_fr_rank<N>.json`` files as ``dump_flight_recorder`` writes them (by hand,
on a timeout with ``AIODIST_FR_DUMP_ON_TIMEOUT=1``, or periodically from the debug server). For
every group the analyzer walks the collectives by sequence number and reports the first one where
the ranks disagree: a rank that never issued an op the others are waiting in ("rank 2 never
issued seq 7 (all_reduce) of group 'default_pg'; ranks [0, 1, 3] are waiting in it"), or ranks
that called different ops, or the same op with different arguments, at one sequence number.
Point-to-point ops are listed but not compared (their two sides differ by design).

Exit status: 0 when the dumps are consistent, 1 when a problem was found, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["analyze", "format_report", "load_dumps", "main", "BadDumpError"]

_FILE = re.compile(r"^aiodist_fr_rank(\d+)\.json$")
_DONE = ("completed",)
_FAILED = ("failed", "timed out")


class BadDumpError(ValueError):
    """A dump that cannot be read or is not in dump_flight_recorder's format."""


def load_dumps(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The dumps in ``paths`` (directories: their ``aiodist_fr_rank<N>.json`` files)."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            names = sorted((n for n in os.listdir(p) if _FILE.match(n)), key=lambda n: int(_FILE.match(n).group(1)))  # type: ignore[union-attr]
            files += [os.path.join(p, n) for n in names]
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise BadDumpError(f"{p}: no such file or directory")
    if not files:
        raise BadDumpError(f"no aiodist_fr_rank<N>.json dumps in {', '.join(paths)}")
    dumps = []
    for f in files:
        try:
            with open(f) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise BadDumpError(f"{f}: cannot read a JSON dump: {exc}") from None
        _validate(data, f)
        dumps.append(data)
    return dumps


def _validate(d: object, where: str) -> None:
    if not isinstance(d, dict):
        raise BadDumpError(f"{where}: a dump is a JSON object, got {type(d).__name__}")
    if not isinstance(d.get("rank"), int) or not isinstance(d.get("groups"), list):
        raise BadDumpError(f"{where}: not a flight-recorder dump (needs an int 'rank' and a 'groups' list)")
    for g in d["groups"]:
        if not isinstance(g, dict) or not isinstance(g.get("group_id"), int) or not isinstance(g.get("entries"), list):
            raise BadDumpError(f"{where}: rank {d['rank']}: a group needs an int 'group_id' and an 'entries' list")
        for e in g["entries"]:
            if not isinstance(e, dict) or not isinstance(e.get("seq"), int) or not isinstance(e.get("op"), str):
                raise BadDumpError(f"{where}: rank {d['rank']}, group {g['group_id']}: an entry needs an int 'seq' and a str 'op'")


def _describe_call(e: dict[str, Any]) -> str:
    same = (e.get("meta") or {}).get("same") or {}
    args = ", ".join(f"{k}={v}" for k, v in sorted(same.items()))
    name = f" [record_comm {e['record_comm']}]" if e.get("record_comm") else ""
    return f"{e['op']}({args}){name}"


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _age(e: dict[str, Any], now: float | None) -> float | None:
    t = e.get("time_started") or e.get("time_issued")
    if now is None or not isinstance(t, (int, float)):
        return None
    return max(0.0, now - t)


def _group_analysis(gid: int, per_rank: dict[int, dict[str, Any]], now: dict[int, float | None], dumped: set[int]) -> dict[str, Any]:
    """One group: the first seq where its ranks diverge, or who is missing from which op."""
    any_g = next(iter(per_rank.values()))
    desc = str(any_g.get("desc") or f"group {gid}")
    members = [int(r) for r in any_g.get("ranks") or sorted(per_rank)]
    colls = {r: {e["seq"]: e for e in g["entries"] if e.get("kind", "collective") == "collective"} for r, g in per_rank.items()}
    issued = {}
    for r, g in per_rank.items():
        seqs = colls[r]
        issued[r] = int(g["seq"]) if isinstance(g.get("seq"), int) else (max(seqs) + 1 if seqs else 0)
    out: dict[str, Any] = {
        "group_id": gid,
        "desc": desc,
        "ranks": members,
        "issued": {str(r): issued[r] for r in sorted(issued)},
        "status": "consistent",
        "problem": None,
        "message": "",
        "in_flight": [],
        "notes": [],
    }
    absent = [r for r in members if r in dumped and r not in per_rank]
    if absent:
        out["notes"].append(f"{_ranks_text(absent)} have no record of group '{desc}' (destroyed there, or never made)")
    # compare from the first seq every rank still holds (ring buffers drop the oldest entries)
    first = max((min(s) if s else issued[r]) for r, s in colls.items())
    last = max(issued.values())
    for seq in range(first, last):
        have = {r: colls[r][seq] for r in per_rank if seq in colls[r]}
        never = sorted(r for r in per_rank if issued[r] <= seq)
        if never:
            if not have:
                continue
            ops = sorted({e["op"] for e in have.values()})
            op = ops[0] if len(ops) == 1 else "/".join(ops)
            waiting = sorted(r for r, e in have.items() if e.get("state") not in _DONE + _FAILED)
            failed = sorted(r for r, e in have.items() if e.get("state") in _FAILED)
            done = sorted(r for r, e in have.items() if e.get("state") in _DONE)
            ages = [a for a in (_age(have[r], now[r]) for r in waiting) if a is not None]
            if waiting and not failed and not done and all(have[r].get("state") == "idle" for r in waiting):
                # a service idling for its leader's next op (idle_until_leader): not a problem
                msg = (
                    f"{_ranks_text(waiting)} {'is' if len(waiting) == 1 else 'are'} idle in seq {seq} ({op}) of group "
                    f"'{desc}', waiting for {_ranks_text(never)} to issue it" + (f" (for up to {max(ages):.1f} s)" if ages else "")
                )
                idle = {"kind": "idle", "seq": seq, "op": op, "missing_ranks": never, "waiting_ranks": waiting}
                out.update(status="idle", message=msg, problem={**idle, "waited_s": max(ages) if ages else None})
                return out
            msg = f"{_ranks_text(never)} never issued seq {seq} ({op}) of group '{desc}'"
            if waiting:
                msg += f"; {_ranks_text(waiting)} {'is' if len(waiting) == 1 else 'are'} waiting in it"
                if ages:
                    msg += f" (for up to {max(ages):.1f} s)"
            if failed:
                msg += f"; it failed or timed out on {_ranks_text(failed)}"
            if done:
                msg += f"; {_ranks_text(done)} completed it"
            last_ops = []
            for r in never:
                prev = colls[r].get(issued[r] - 1)
                last_ops.append(
                    {
                        "rank": r,
                        "last_seq": issued[r] - 1,
                        "last_op": prev["op"] if prev else None,
                        "last_state": prev.get("state") if prev else None,
                    }
                )
            tails = [
                f"rank {x['rank']}'s last op is seq {x['last_seq']} ({x['last_op']}, {x['last_state']})" for x in last_ops if x["last_op"]
            ]
            if tails:
                msg += "; " + "; ".join(tails)
            out.update(
                status="missing",
                message=msg,
                problem={
                    "kind": "missing",
                    "seq": seq,
                    "op": op,
                    "missing_ranks": never,
                    "waiting_ranks": waiting,
                    "failed_ranks": failed,
                    "completed_ranks": done,
                    "last_ops": last_ops,
                    "waited_s": max(ages) if ages else None,
                },
            )
            return out
        if len(have) < len(per_rank):
            continue  # dropped from some ring buffer: nothing to compare
        calls = {r: (e["op"], json.dumps((e.get("meta") or {}).get("same") or {}, sort_keys=True, default=str)) for r, e in have.items()}
        if len(set(calls.values())) > 1:
            variants: dict[tuple[str, str], list[int]] = {}
            for r in sorted(calls):
                variants.setdefault(calls[r], []).append(r)
            sides = [{"ranks": rs, "op": have[rs[0]]["op"], "call": _describe_call(have[rs[0]])} for rs in variants.values()]
            names = {str(s["op"]) for s in sides}
            what = "called different ops" if len(names) > 1 else f"called {next(iter(names))} with different arguments"
            msg = f"seq {seq} of group '{desc}': ranks {what}: " + "; ".join(f"{_ranks_text(s['ranks'])} called {s['call']}" for s in sides)
            out.update(status="diverged", message=msg, problem={"kind": "mismatch", "seq": seq, "sides": sides})
            return out
    # consistent: what is still running (every rank issued it; some have not finished)
    for seq in range(first, last):
        have = {r: colls[r][seq] for r in per_rank if seq in colls[r]}
        pending = sorted(r for r, e in have.items() if e.get("state") not in _DONE)
        if pending and have:
            e0 = next(iter(have.values()))
            states = {str(r): have[r].get("state") for r in sorted(have)}
            out["in_flight"].append({"seq": seq, "op": e0["op"], "states": states})
            bad = sorted(r for r in pending if have[r].get("state") in _FAILED)
            if bad and out["problem"] is None:
                err = have[bad[0]].get("error") or have[bad[0]].get("state")
                out.update(
                    status="failed",
                    message=f"seq {seq} ({e0['op']}) of group '{desc}' failed on {_ranks_text(bad)}: {err}",
                    problem={"kind": "failed", "seq": seq, "op": e0["op"], "failed_ranks": bad, "error": err},
                )
    if out["problem"] is None:
        out["message"] = (
            f"group '{desc}': {len(per_rank)} ranks agree on seqs {first}..{last - 1}"
            if last > first
            else f"group '{desc}': no collectives to compare"
        )
        if out["in_flight"]:
            f0 = out["in_flight"][0]
            out["message"] += (
                f"; seq {f0['seq']} ({f0['op']}) is still running ({', '.join(f'rank {r}: {s}' for r, s in f0['states'].items())})"
            )
    return out


def _rank_summary(d: dict[str, Any]) -> dict[str, Any]:
    """Where one rank is: its oldest unfinished op, else its newest finished one."""
    now = d.get("time") if isinstance(d.get("time"), (int, float)) else None
    pending, last = [], None
    for g in d["groups"]:
        for e in g["entries"]:
            if e.get("kind") == "loop":  # the loop watchdog's notes (loop_blocked) are not ops
                continue
            item = {
                "group_id": g["group_id"],
                "group": g.get("desc"),
                "op": e["op"],
                "seq": e["seq"],
                "kind": e.get("kind", "collective"),
                "state": e.get("state"),
                "age_s": _age(e, now),
            }
            if e.get("state") in _DONE + _FAILED:
                if last is None or (e.get("time_done") or 0) >= (last[1] or 0):
                    last = (item, e.get("time_done"))
            else:
                pending.append((e.get("time_issued") or 0, item))
    pending.sort(key=lambda p: p[0])
    return {"rank": d["rank"], "pending": [p[1] for p in pending], "last_finished": last[0] if last else None}


def analyze(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare the ranks' dumps (``dump_flight_recorder``'s dicts); a JSON-able result with
    ``ok``, one entry per group (``status``: consistent / idle / missing / diverged / failed, the
    ``problem`` and a one-line ``message``), each rank's position, and ``problems`` (lines)."""
    if not dumps:
        raise BadDumpError("no dumps to analyze")
    by_rank: dict[int, dict[str, Any]] = {}
    for i, d in enumerate(dumps):
        _validate(d, f"dump {i}")
        if d["rank"] in by_rank:
            raise BadDumpError(f"two dumps for rank {d['rank']}")
        by_rank[d["rank"]] = d
    ranks = sorted(by_rank)
    sizes = [int(d["world_size"]) for d in dumps if isinstance(d.get("world_size"), int)]
    world_size = max([*sizes, ranks[-1] + 1])
    missing_dumps = [r for r in range(world_size) if r not in by_rank]
    groups: dict[int, dict[int, dict[str, Any]]] = {}
    for r in ranks:
        for g in by_rank[r]["groups"]:
            groups.setdefault(g["group_id"], {})[r] = g
    now = {r: by_rank[r].get("time") for r in ranks}
    results = [_group_analysis(gid, groups[gid], now, set(ranks)) for gid in sorted(groups)]
    problems = [g["message"] for g in results if g["problem"] is not None and g["problem"]["kind"] != "idle"]
    if missing_dumps:
        problems.append(f"no dump from {_ranks_text(missing_dumps)} of {world_size}: what they were doing is unknown")
    return {
        "ok": not problems,
        "world_size": world_size,
        "ranks": ranks,
        "missing_dumps": missing_dumps,
        "groups": results,
        "rank_positions": [_rank_summary(by_rank[r]) for r in ranks],
        "problems": problems,
    }


def _position_text(p: dict[str, Any]) -> str:
    if p["pending"]:
        e = p["pending"][0]
        age = f", for {e['age_s']:.1f} s" if e.get("age_s") is not None else ""
        more = f" (+{len(p['pending']) - 1} more unfinished)" if len(p["pending"]) > 1 else ""
        return f"in {e['op']} seq {e['seq']} of group '{e['group']}' ({e['state']}{age}){more}"
    e = p["last_finished"]
    if e is None:
        return "no ops recorded"
    return f"idle; last finished {e['op']} seq {e['seq']} of group '{e['group']}' ({e['state']})"


def format_report(result: dict[str, Any]) -> str:
    """The analysis as text a person reads first thing after a hang."""
    lines = []
    head = "CONSISTENT" if result["ok"] else f"PROBLEM{'S' if len(result['problems']) > 1 else ''} FOUND"
    lines.append(
        f"{head}: {len(result['ranks'])}/{result['world_size']} rank dumps, {len(result['groups'])} group{'' if len(result['groups']) == 1 else 's'}"
    )
    for p in result["problems"]:
        lines.append(f"  ! {p}")
    lines.append("")
    lines.append("Groups:")
    for g in result["groups"]:
        lines.append(
            f"  [{g['status']}] '{g['desc']}' (id {g['group_id']}, ranks {g['ranks']}): seqs issued "
            + ", ".join(f"rank {r}: {n}" for r, n in g["issued"].items())
        )
        if g["problem"] is None:
            lines.append(f"      {g['message']}")
        for n in g["notes"]:
            lines.append(f"      note: {n}")
    lines.append("")
    lines.append("Ranks:")
    for p in result["rank_positions"]:
        lines.append(f"  rank {p['rank']}: {_position_text(p)}")
    for r in result["missing_dumps"]:
        lines.append(f"  rank {r}: no dump")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiodist.debug.analyze", description="Find where the ranks of a job diverged, from their flight-recorder dumps."
    )
    parser.add_argument("paths", nargs="+", metavar="DIR", help="a directory of aiodist_fr_rank<N>.json dumps (or the dump files)")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    args = parser.parse_args(argv)
    try:
        result = analyze(load_dumps(args.paths))
    except BadDumpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_report(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
