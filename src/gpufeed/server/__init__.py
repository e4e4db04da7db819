"""gpufeed's server: decode pipelines that stream batches to trainers over gRPC.

Run it with ``gpufeed-server --data-root DIR`` (or ``python -m gpufeed.server``);
embed it with ``FeedServer(ServerConfig(data_roots=[...]))``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers; at run time, __getattr__ below
    from .app import FeedServer
    from .config import Limits, ServerConfig

__all__ = ["FeedServer", "Limits", "ServerConfig"]


def __getattr__(name: str):
    # Imported when first used, so that ``gpufeed-server`` can tell a client-only
    # install (no PyAV, no prometheus-client) what to install instead of failing
    # on this package's import.
    if name == "FeedServer":
        from .app import FeedServer

        return FeedServer
    if name in ("Limits", "ServerConfig"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
