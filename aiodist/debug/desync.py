"""DETAIL's desync check, re-exported from the instrumentation layer (``aiodist._instrument.desync``).
c10d finds ``check_fingerprint`` here when it runs a DETAIL collective, so a test may patch it here."""

from aiodist._instrument.desync import FINGERPRINT_BYTES, FINGERPRINT_TAG, DesyncError, check_fingerprint, describe_mismatch, fingerprint

__all__ = ["check_fingerprint", "describe_mismatch", "fingerprint", "DesyncError", "FINGERPRINT_BYTES", "FINGERPRINT_TAG"]
