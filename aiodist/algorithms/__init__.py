"""Collective algorithms written over a two-method point-to-point interface.

- ``p2p``: the ``P2P`` protocol a transport implements for one op, and ``LocalP2P`` /
  ``local_world`` (in memory, bounded) for tests.
- ``schedule``: pure schedule math (rings, chunks, binomial trees, recursive doubling and
  halving with extra ranks folded in, Bruck, pairwise, dissemination).
- ``thresholds``: the one table of size thresholds between schedules (``AIODIST_ALGO_*``).
- ``collectives``: the async collectives carrying the schedules out on numpy arrays in place.
"""

from aiodist.algorithms.collectives import (
    Combine,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from aiodist.algorithms.p2p import CHANNEL_TAG_LIMIT, P2P, TAG_LIMIT, LocalP2P, LocalWorld, SubP2P, local_world
from aiodist.algorithms.thresholds import Thresholds

__all__ = [
    "P2P",
    "TAG_LIMIT",
    "CHANNEL_TAG_LIMIT",
    "SubP2P",
    "Combine",
    "LocalP2P",
    "LocalWorld",
    "Thresholds",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "local_world",
    "reduce",
    "reduce_scatter",
    "scatter",
]
