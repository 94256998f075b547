"""The rank-to-rank transport: the only code that touches sockets for data between ranks.

``Transport.start(store, rank, world_size, token=..., timeout=...)`` listens (TCP port 0 and, on
Linux, an abstract Unix socket for same-host peers), publishes its address in the store, and
connects to peers on first use. ``transport.channel(group_id, seq, global_ranks)`` is the
``P2P`` the collective algorithms run over. Rules: ``aiodist/transport/_transport.py``.
"""

from aiodist.transport._address import PeerAddress, address_key, host_id
from aiodist.transport._channel import Channel
from aiodist.transport._transport import Transport
from aiodist.wire.frame import FrameLimits

__all__ = ["Transport", "Channel", "PeerAddress", "FrameLimits", "address_key", "host_id"]
