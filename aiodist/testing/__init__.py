"""Test helpers shipped with aiodist: conformance kits every implementation must pass."""

from aiodist.testing.store_kit import STORE_CHECKS, check_store

__all__ = ["check_store", "STORE_CHECKS"]
