"""The launcher API (torch.distributed.launcher): ``LaunchConfig``, ``launch_agent``, ``elastic_launch``.

``python -m aiodist.run`` (``aiodist-run``) is built on it; see docs/launcher.md.
"""

from aiodist.launcher.api import (
    ChildFailedError,
    LaunchConfig,
    RendezvousError,
    RendezvousTimeoutError,
    SignalException,
    alaunch_agent,
    elastic_launch,
    launch_agent,
)

__all__ = [
    "LaunchConfig",
    "launch_agent",
    "alaunch_agent",
    "elastic_launch",
    "ChildFailedError",
    "SignalException",
    "RendezvousError",
    "RendezvousTimeoutError",
]
