"""Test helpers shipped with aiodist: conformance kits every implementation must pass, and
``until`` for waiting on a condition with a deadline."""

from aiodist.testing.store_kit import STORE_CHECKS, check_store
from aiodist.testing.waiting import until

__all__ = ["check_store", "STORE_CHECKS", "until"]
