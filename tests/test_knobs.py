"""aiodist.knobs: every AIODIST_* variable declared once (the source holds no undeclared one),
docs/environment.md is the registry's table, one parser per kind whose errors name the
variable, and the modules read their knobs through it."""

from __future__ import annotations

import pathlib
import re

import pytest

from aiodist import knobs
from aiodist.knobs import KNOBS, knob, parse_size, value

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_aiodist_variable_in_the_source_is_declared() -> None:
    names: set[str] = set()
    for path in [*(ROOT / "aiodist").rglob("*.py"), *(ROOT / "aiodist_cuda").rglob("*.py")]:
        names |= set(re.findall(r"[\"'](AIODIST_[A-Z0-9_]+)[\"']", path.read_text()))
    assert names, "found no AIODIST_ name at all"
    undeclared = []
    for name in sorted(names):
        try:
            knob(name)
        except KeyError:
            undeclared.append(name)
    assert not undeclared, f"declare these in aiodist/knobs.py: {undeclared}"


def test_the_docs_page_is_the_registrys_table() -> None:
    page = (ROOT / "docs" / "environment.md").read_text()
    table = page.split("<!-- knobs-table -->\n", 1)[1]
    assert table == knobs.table(), "docs/environment.md is out of date: paste aiodist.knobs.table() after the marker"


@pytest.mark.parametrize(
    ("name", "raw", "want"),
    [
        ("AIODIST_SHM_BYTES", "64K", 65536),
        ("AIODIST_SHM_BYTES", "0", 0),
        ("AIODIST_STRIPE_MIN_BYTES", "1M", 1 << 20),
        ("AIODIST_HANDSHAKE_TIMEOUT", "2.5", 2.5),
        ("AIODIST_FR_BUFFER_SIZE", "10", 10),
        ("AIODIST_DDP_BACKWARD", "Thread", "thread"),
        ("AIODIST_STRIPE_MIN_BYTES", "", 256 << 10),  # blank: the default
    ],
)
def test_values_are_parsed_by_kind(name: str, raw: str, want: object) -> None:
    assert value(name, {name: raw}) == want


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("AIODIST_SHM_BYTES", "lots", "a byte count"),
        ("AIODIST_SHM_BYTES", "-1", "a byte count"),
        ("AIODIST_HANDSHAKE_TIMEOUT", "0", "> 0"),
        ("AIODIST_HANDSHAKE_TIMEOUT", "inf", "a number of seconds"),
        ("AIODIST_SHM_SPIN_US", "-5", ">= 0"),
        ("AIODIST_FR_BUFFER_SIZE", "1.5", "an integer"),
        ("AIODIST_DDP_BACKWARD", "gpu", "one of auto, thread, loop"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_it_expects(name: str, raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r}: expected")) as info:
        value(name, {name: raw})
    assert says in str(info.value)


def test_one_size_parser() -> None:
    assert parse_size("16M") == 16 << 20 and parse_size(" 4 KiB ") == 4096 and parse_size("2g") == 2 << 30
    assert parse_size("-1", signed=True) == -1
    with pytest.raises(ValueError):
        parse_size("-1")
    with pytest.raises(ValueError):
        parse_size("4T")


def test_the_modules_read_their_knobs_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist._instrument.recorder import buffer_size
    from aiodist._startup import warn_interval
    from aiodist.algorithms.thresholds import from_env
    from aiodist.shm._manager import segment_bytes, spin_seconds
    from aiodist.transport._transport import _handshake_timeout, _stripe_min_bytes

    assert segment_bytes({"AIODIST_SHM_BYTES": "1M"}) == 1 << 20
    assert spin_seconds({"AIODIST_SHM_SPIN_US": "250"}) == pytest.approx(250e-6)
    monkeypatch.setenv("AIODIST_STRIPE_MIN_BYTES", "2M")
    monkeypatch.setenv("AIODIST_HANDSHAKE_TIMEOUT", "3")
    monkeypatch.setenv("AIODIST_FR_BUFFER_SIZE", "7")
    monkeypatch.setenv("AIODIST_INIT_WARN_INTERVAL", "0")
    assert _stripe_min_bytes() == 2 << 20 and _handshake_timeout(None) == 3.0 and buffer_size() == 7
    assert warn_interval() == float("inf")
    assert from_env({"AIODIST_ALGO_ALLREDUCE_CMA_MIN": "8M"}).allreduce_cma_min == 8 << 20
    monkeypatch.setenv("AIODIST_SHM_BYTES", "64X")
    with pytest.raises(ValueError, match="AIODIST_SHM_BYTES='64X': expected a byte count"):
        segment_bytes()


def test_effective_values_show_what_is_set() -> None:
    env = {"AIODIST_SHM_BYTES": "1M", "AIODIST_ALGO_LANE_MAX": "0", "AIODIST_HANDSHAKE_TIMEOUT": "soon"}
    got = {k["name"]: k for k in knobs.effective(env) if k["set"] is not None}
    assert got["AIODIST_SHM_BYTES"]["value"] == 1 << 20 and got["AIODIST_ALGO_LANE_MAX"]["value"] == "0"
    assert str(got["AIODIST_HANDSHAKE_TIMEOUT"]["value"]).startswith("invalid: AIODIST_HANDSHAKE_TIMEOUT='soon'")
    assert len(got) == 3 and len(KNOBS) >= 20


def test_no_module_reads_a_knob_past_the_registry() -> None:
    """Every AIODIST_* variable is read through aiodist.knobs (value/knob), in aiodist and
    aiodist_cuda alike; setting one for a child process is not a read."""
    read = re.compile(r"os\.environ\.get\(\s*[\"']AIODIST_|os\.getenv\(\s*[\"']AIODIST_|os\.environ\[[\"']AIODIST_\w+[\"']\](?!\s*=[^=])")
    bad = []
    for path in [*(ROOT / "aiodist").rglob("*.py"), *(ROOT / "aiodist_cuda").rglob("*.py")]:
        if path.name == "knobs.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if read.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "read these through aiodist.knobs.value():\n" + "\n".join(bad)
