"""Defaults shared across aiodist, as torch.distributed.constants has them."""

from datetime import timedelta

__all__ = ["default_pg_timeout", "default_store_timeout"]

# torch's default process-group timeout (30 minutes); also the rendezvous store's timeout.
default_pg_timeout = timedelta(minutes=30)
# torch's default TCPStore timeout.
default_store_timeout = timedelta(seconds=300)
