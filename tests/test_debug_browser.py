"""The debug server's page in a real browser: headless Chromium loads ``/`` of a 2-rank job where
rank 1 never issues the all_reduce rank 0 waits in, and of one where rank 1's event loop is
blocked, and the DOM it built says so. .ci/run installs Debian's chromium; elsewhere these skip
where no Chromium is installed (``apt-get install chromium``)."""

from __future__ import annotations

import asyncio
import html
import re
import shutil
import subprocess
import tempfile
from typing import Any

import pytest
from aiohttp import ClientSession
from test_debug_server import blocked_job, blocked_line, idle_service_job, stuck_job

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)"),
    pytest.mark.one_loop(
        reason="its time is Chromium's, a child process; the debug server's pages are checked on both loops in test_debug_server.py"
    ),
]


async def chromium(*args: str, timeout: float = 30) -> str:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:  # a throwaway profile: no state between runs
        proc = await asyncio.create_subprocess_exec(
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            *args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
    assert proc.returncode == 0, f"chromium exited {proc.returncode}"
    return out.decode()


def text_of(dom: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))


async def test_page_in_chromium_names_the_stuck_rank() -> None:
    async def probe(url: str, s: ClientSession) -> Any:
        return await chromium("--dump-dom", url + "/")

    dom = await stuck_job(probe)
    text = text_of(dom)
    assert "aiodist debug: Ranks" in text
    assert "STUCK: rank 1: never issued seq 1" in text and "2/2 ranks responded" in text
    assert "Stuck: rank 1" in text
    row1 = re.search(r"<tr class=\"stuck\" id=\"rank1\">(.*?)</tr>", dom, re.S)
    assert row1 is not None, dom[:2000]
    row1_text = text_of(row1.group(1))
    assert "STUCK" in row1_text and "never issued seq 1 (all_reduce) of group 'default_pg' that rank 0 is waiting in" in row1_text
    assert "default_pg: 1 (behind)" in row1_text
    row0 = re.search(r"<tr class=\"waiting\" id=\"rank0\">(.*?)</tr>", dom, re.S)
    assert row0 is not None
    assert "all_reduce seq 1 of group 'default_pg' (started)" in text_of(row0.group(1))
    assert "rank 1 never issued seq 1 (all_reduce) of group 'default_pg'; rank 0 is waiting in it" in text


async def test_page_in_chromium_says_idle_for_an_idle_service_and_stuck_for_a_hang() -> None:
    """A service group (idle_until_leader): rank 1 waiting for the leader's next request is IDLE
    on a green banner, not STUCK; an op the leader issued that rank 1 does not follow is STUCK
    past the page's stated threshold."""

    async def probe(url: str, s: ClientSession) -> Any:
        return await chromium("--dump-dom", url + "/")

    idle, stuck = await idle_service_job(probe)
    assert '<div class="banner ok" id="summary">IDLE: rank 1: idle for' in idle, idle[:3000]
    assert "STUCK" not in text_of(idle) and "No stuck rank" in text_of(idle)
    assert "waiting for rank 0 to issue seq 1 (broadcast) of group 'default_pg'" in text_of(idle)
    assert '<div class="banner bad" id="summary">STUCK: rank 1: never issued seq 2 (all_reduce)' in stuck, stuck[:3000]
    assert "have not followed within 0.3 s" in text_of(stuck)


async def test_page_in_chromium_names_the_blocked_loop() -> None:
    async def probe(url: str, s: ClientSession) -> Any:
        return await chromium("--dump-dom", url + "/")

    dom, took = await blocked_job(probe)
    text = text_of(dom)
    assert took < 5.0, took  # Chromium's start included
    assert "BLOCKED: rank 1: event loop blocked for " in text and f"at {blocked_line()}" in text, text[:2000]
    row1 = re.search(r"<tr class=\"stuck\" id=\"rank1\">(.*?)</tr>", dom, re.S)
    assert row1 is not None, dom[:2000]
    assert "BLOCKED" in text_of(row1.group(1)) and blocked_line() in text_of(row1.group(1))
    assert "Stuck: rank 1" in text
