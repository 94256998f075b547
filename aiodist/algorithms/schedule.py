"""Schedule math for the collectives: who talks to whom, in which step, about which elements.

Pure functions over ints, no asyncio and no arrays, so every schedule can be simulated for
every world size in a test (tests/test_schedules.py). Rules these schedules keep:
- Every rank computes its own part of a schedule from ``(rank, size[, root])`` alone, and the
  parts agree: when rank a's step says "send X to b", rank b's step says "receive X from a".
- Chunks are near-equal: N elements in ``parts`` chunks differ in size by at most one, the
  larger ones first. Sender and receiver derive a message's size from the same bounds.
- Rooted schedules relabel ranks by a virtual rank ``(rank - root) % size``, so the root is
  virtual rank 0 and one tree shape serves every root.
- Pairwise reductions (recursive doubling/halving, the fold of extra ranks) always put the
  *lower* rank's value first, so both partners compute the same expression and get the same
  bits even where an operation is not bitwise commutative (NaN payloads, ``minimum(0.0, -0.0)``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "BruckStep",
    "DoublingStep",
    "Fold",
    "HalvingStep",
    "RingStep",
    "Tree",
    "binomial_tree",
    "bruck_steps",
    "chain",
    "chunk_bounds",
    "dissemination_rounds",
    "doubling_steps",
    "fold",
    "halving_steps",
    "pairwise_steps",
    "pieces",
    "rd_partners",
    "real_rank",
    "ring_all_gather",
    "ring_neighbors",
    "ring_reduce_scatter",
]


def _check(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of size {size}")


# -- chunks ------------------------------------------------------------------------------------


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Offsets ``b`` (``parts + 1`` of them) splitting ``n`` elements into near-equal chunks:
    chunk i is ``[b[i], b[i+1])``; the first ``n % parts`` chunks hold one element more."""
    if n < 0 or parts < 1:
        raise ValueError(f"cannot split {n} elements into {parts} chunks")
    q, r = divmod(n, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


def pieces(start: int, stop: int, piece: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into near-equal pipelining pieces of at most ``piece`` elements.

    An empty range has no pieces (so nothing is sent for it). Both ends of a message derive the
    same pieces from the same range, which is what keeps their message counts and tags in step.
    """
    if piece < 1:
        raise ValueError(f"piece size must be at least 1 element, got {piece}")
    n = stop - start
    if n <= 0:
        return []
    b = chunk_bounds(n, -(-n // piece))
    return [(start + b[i], start + b[i + 1]) for i in range(len(b) - 1)]


# -- ring --------------------------------------------------------------------------------------


class RingStep(NamedTuple):
    """One ring step: send chunk ``send`` to the right neighbour, receive chunk ``recv`` from the left."""

    send: int
    recv: int


def ring_neighbors(rank: int, size: int) -> tuple[int, int]:
    """``(left, right)``: data flows from left to this rank to right."""
    _check(rank, size)
    return (rank - 1) % size, (rank + 1) % size


def ring_reduce_scatter(rank: int, size: int) -> list[RingStep]:
    """``size - 1`` steps after which rank r holds chunk r reduced over every rank.

    The received chunk is combined into the local one and, one step later, sent on; so step s+1
    sends what step s received, and the last step receives chunk ``rank`` itself.
    """
    _check(rank, size)
    return [RingStep((rank - s - 1) % size, (rank - s - 2) % size) for s in range(size - 1)]


def ring_all_gather(rank: int, size: int) -> list[RingStep]:
    """``size - 1`` steps that spread chunk r from rank r to everyone; step 0 sends the rank's own
    chunk, step s+1 forwards what step s received. Follows ``ring_reduce_scatter`` seamlessly."""
    _check(rank, size)
    return [RingStep((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)]


def chain(rank: int, size: int, root: int) -> tuple[int | None, int | None]:
    """``(prev, next)`` in the pipeline root -> root+1 -> ... (None at the ends)."""
    _check(rank, size)
    _check(root, size)
    v = (rank - root) % size
    prev = (rank - 1) % size if v > 0 else None
    nxt = (rank + 1) % size if v < size - 1 else None
    return prev, nxt


# -- binomial tree -----------------------------------------------------------------------------


class Tree(NamedTuple):
    """A rank's place in a binomial tree. The i-th of ``children`` is ``2**i`` virtual ranks away
    and heads a subtree of ``2**i`` ranks (fewer at the edge of a size that is not a power of
    two): a reduction receives in this order (small subtrees finish first), a broadcast sends in
    reverse (the big subtrees have the longest way to go)."""

    parent: int | None
    children: list[int]


def binomial_tree(rank: int, size: int, root: int) -> Tree:
    """Binomial tree over virtual ranks ``v = (rank - root) % size``: v's parent is v with its
    lowest set bit cleared, its children are ``v + 2**k`` for every ``2**k`` below that bit.
    Depth is ``ceil(log2(size))``; the subtree of v is the contiguous range ``[v, v + lowbit(v))``."""
    _check(rank, size)
    _check(root, size)
    v = (rank - root) % size
    parent = None if v == 0 else ((v & (v - 1)) + root) % size
    limit = v & -v if v else 1 << max(size - 1, 0).bit_length()
    children = []
    k = 1
    while k < limit and v + k < size:
        children.append((v + k + root) % size)
        k <<= 1
    return Tree(parent, children)


# -- recursive doubling / halving, with extra ranks folded in -----------------------------------


class Fold(NamedTuple):
    """How a rank takes part in a power-of-two schedule when ``size`` is not a power of two.

    The first ``2 * extra`` ranks pair up (2i, 2i+1): the odd one hands its data to the even one
    (the *keeper*) and sits out, receiving the result at the end. ``vrank`` is the rank's place
    among the ``pof2`` participants (None for one that sits out); ``partner`` is the other rank
    of its pair (None when not paired)."""

    pof2: int
    vrank: int | None
    partner: int | None


def fold(rank: int, size: int) -> Fold:
    _check(rank, size)
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    if rank < 2 * extra:
        if rank % 2:
            return Fold(pof2, None, rank - 1)
        return Fold(pof2, rank // 2, rank + 1)
    return Fold(pof2, rank - extra, None)


def real_rank(vrank: int, size: int) -> int:
    """The rank that plays virtual rank ``vrank`` of ``fold``; increasing, so "lower virtual
    rank" and "lower rank" agree."""
    extra = size - (1 << (size.bit_length() - 1))
    return 2 * vrank if vrank < extra else vrank + extra


def rd_partners(vrank: int, pof2: int) -> list[int]:
    """Recursive doubling: the virtual partner of each step (distance 1, 2, 4, ...)."""
    return [vrank ^ (1 << k) for k in range(pof2.bit_length() - 1)]


class HalvingStep(NamedTuple):
    """Recursive halving: send chunks ``[send[0], send[1])`` to virtual ``partner``, receive its
    copy of ``[keep[0], keep[1])`` and combine it into yours."""

    partner: int
    keep: tuple[int, int]
    send: tuple[int, int]


def halving_steps(vrank: int, pof2: int) -> list[HalvingStep]:
    """Reduce-scatter over ``pof2`` chunks by recursive halving (distance pof2/2, ..., 1): the
    lower partner keeps the lower half. Afterwards virtual rank v holds chunk v fully reduced."""
    steps = []
    lo, hi = 0, pof2
    mask = pof2 >> 1
    while mask:
        mid = lo + mask
        low = (lo, mid)
        high = (mid, hi)
        if vrank & mask:
            steps.append(HalvingStep(vrank ^ mask, high, low))
            lo = mid
        else:
            steps.append(HalvingStep(vrank ^ mask, low, high))
            hi = mid
        mask >>= 1
    return steps


class DoublingStep(NamedTuple):
    """Recursive doubling all-gather: send your chunks ``mine`` to virtual ``partner``, receive its
    chunks ``theirs`` (adjacent to yours, so the union is one contiguous range again)."""

    partner: int
    mine: tuple[int, int]
    theirs: tuple[int, int]


def doubling_steps(vrank: int, pof2: int) -> list[DoublingStep]:
    """All-gather of ``pof2`` chunks (v owns chunk v) by recursive doubling, distance 1, 2, ...:
    the exact reverse of ``halving_steps``."""
    steps = []
    lo, hi = vrank, vrank + 1
    mask = 1
    while mask < pof2:
        n = hi - lo
        if vrank & mask:
            theirs = (lo - n, lo)
        else:
            theirs = (hi, hi + n)
        steps.append(DoublingStep(vrank ^ mask, (lo, hi), theirs))
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
        mask <<= 1
    return steps


# -- all-gather (Bruck), all-to-all, barrier ---------------------------------------------------


class BruckStep(NamedTuple):
    """Send your first ``blocks`` blocks (in your rotated order: your own block first) to
    ``send_to``; receive ``recv_from``'s first ``blocks`` blocks, which become your blocks
    ``[have, have + blocks)``."""

    send_to: int
    recv_from: int
    have: int
    blocks: int


def bruck_steps(rank: int, size: int) -> list[BruckStep]:
    """Bruck's all-gather: ``ceil(log2(size))`` steps for any size. A rank's working buffer holds
    blocks ``rank, rank+1, ...`` (mod size) in that order; in the step at distance d it sends its
    first ``min(d, size - d)`` blocks to ``rank - d`` and appends as many from ``rank + d``."""
    _check(rank, size)
    steps = []
    d = 1
    while d < size:
        steps.append(BruckStep((rank - d) % size, (rank + d) % size, d, min(d, size - d)))
        d <<= 1
    return steps


def pairwise_steps(rank: int, size: int) -> list[tuple[int, int]]:
    """All-to-all by pairwise exchange: step k (1 .. size-1) sends to ``rank + k`` and receives
    from ``rank - k``, so every ordered pair meets exactly once and both ends agree on the step."""
    _check(rank, size)
    return [((rank + k) % size, (rank - k) % size) for k in range(1, size)]


def dissemination_rounds(rank: int, size: int) -> list[tuple[int, int]]:
    """Dissemination barrier: round k sends to ``rank + 2**k`` and receives from ``rank - 2**k``;
    after ``ceil(log2(size))`` rounds every rank has heard, through some chain, from every rank."""
    _check(rank, size)
    out = []
    d = 1
    while d < size:
        out.append(((rank + d) % size, (rank - d) % size))
        d <<= 1
    return out
