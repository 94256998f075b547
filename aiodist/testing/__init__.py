"""Test helpers shipped with aiodist: conformance kits every implementation must pass,
``until`` for waiting on a condition with a deadline, and ``run_world`` for n ranks on one loop."""

from aiodist.testing.store_kit import STORE_CHECKS, check_store
from aiodist.testing.waiting import until
from aiodist.testing.world import run_world

__all__ = ["check_store", "STORE_CHECKS", "until", "run_world"]
