"""Which gradients share a bucket: a pure decision over sizes and dtypes, torch's rules.

``assign_buckets(nbytes, keys, limits, order)`` walks the parameters in ``order`` and packs them
into buckets, one open bucket per key (a dtype: a bucket is one flat array of one dtype). The
rules, in order:

1. A parameter joins the open bucket of its key (a new one if there is none).
2. When that bucket's size reaches the key's current limit (``>=``, counting the parameter just
   added), the bucket closes and is appended to the result; the key moves on to its next limit,
   and stays on the last one. So ``limits=[1 MiB, 25 MiB]`` makes each dtype's first bucket small.
3. After the last parameter, the buckets still open are appended, in the order they were opened.
4. The result lists buckets in the order they close, which is the order they become ready when
   gradients arrive in ``order``; each bucket lists its members in ``order`` too.

This is torch's ``_compute_bucket_assignment_by_size`` when given explicit indices (the rebuild
DDP does from the observed gradient order); DDP here calls it with the reverse of registration
order (:func:`reverse_order`), the order backward produces gradients in a feed-forward model, and
with ``limits = [first_bucket_bytes, bucket_cap_bytes]`` (see :func:`bucket_limits`). A test
checks it against torch's own function where torch is installed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["DEFAULT_FIRST_BUCKET_BYTES", "assign_buckets", "bucket_limits", "reverse_order"]

#: torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket's cap when bucket_cap_mb is the default
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
MB = 1024 * 1024


def bucket_limits(bucket_cap_mb: float | None) -> list[int]:
    """The size limits torch's DDP uses: a 1 MiB first bucket when ``bucket_cap_mb`` is left at
    its default (None or 25), then ``bucket_cap_mb``; an explicit cap applies to every bucket."""
    if bucket_cap_mb is None:
        bucket_cap_mb = 25
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    cap = max(1, int(bucket_cap_mb * MB))
    if bucket_cap_mb == 25 and DEFAULT_FIRST_BUCKET_BYTES < cap:
        return [DEFAULT_FIRST_BUCKET_BYTES, cap]
    return [cap]


def reverse_order(n: int) -> list[int]:
    """Parameter indices last-registered first: the order backward makes their gradients."""
    return list(range(n - 1, -1, -1))


def assign_buckets(nbytes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int], order: Sequence[int]) -> list[list[int]]:
    """Buckets of parameter indices (see the module docstring for the rules)."""
    if len(nbytes) != len(keys):
        raise ValueError(f"{len(nbytes)} sizes but {len(keys)} keys")
    if not limits or any(int(v) <= 0 for v in limits):
        raise ValueError(f"limits must be a non-empty list of positive byte counts, got {list(limits)}")
    if sorted(order) != list(range(len(nbytes))):
        raise ValueError("order must list every parameter index exactly once")
    open_: dict[Hashable, tuple[list[int], int]] = {}  # key -> (members, bytes); dicts keep opening order
    step: dict[Hashable, int] = {}
    out: list[list[int]] = []
    for i in order:
        key = keys[i]
        members, size = open_.get(key, ([], 0))
        members.append(i)
        size += int(nbytes[i])
        k = step.get(key, 0)
        if size >= limits[k]:
            out.append(members)
            open_.pop(key, None)
            step[key] = min(k + 1, len(limits) - 1)
        else:
            open_[key] = (members, size)
    out.extend(members for members, _ in open_.values())
    return out
