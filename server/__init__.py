"""gpufeed's server: decode pipelines that stream batches to trainers over gRPC.

Run it with ``gpufeed-server --data-root DIR`` (or ``python -m gpufeed.server``);
embed it with ``FeedServer(ServerConfig(data_roots=[...]))``.
"""

from .app import FeedServer, ServerConfig
from .request import Limits

__all__ = ["FeedServer", "Limits", "ServerConfig"]
