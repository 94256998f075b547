"""The rank-to-rank transport: the only code that touches sockets for data between ranks.

``Transport.start(store, rank, world_size, token=..., timeout=...)`` listens (TCP port 0 and, on
Linux, an abstract Unix socket for same-host peers), publishes its address in the store, and
connects to peers on first use. ``transport.channel(group_id, seq, global_ranks)`` is the
``P2P`` the collective algorithms run over. ``Transport`` is a façade over its parts (dialer,
send lines, inbox, standing; ``aiodist/transport/_transport.py`` lists them and their seams),
each with its rules in its module docstring.
``Mailbox`` (with ``PostedRecv`` and ``StagedMessage``) is its matching table of posted
receives and early messages, public so that another backend can match alike (the in-memory
one does). The transport imports nothing from ``aiodist.algorithms`` (tests/test_layers.py).
"""

from aiodist.transport._address import PeerAddress, address_key, host_id
from aiodist.transport._channel import Channel
from aiodist.transport._mailbox import Mailbox, PostedRecv, StagedMessage, describe_key
from aiodist.transport._transport import Transport
from aiodist.wire.frame import FrameLimits

__all__ = [
    "Transport",
    "Channel",
    "PeerAddress",
    "FrameLimits",
    "Mailbox",
    "PostedRecv",
    "StagedMessage",
    "address_key",
    "describe_key",
    "host_id",
]
