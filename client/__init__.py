"""gpufeed's trainer-side library.

    from gpufeed.client import FeedClient

    with FeedClient("localhost:50051") as feed:
        loader = feed.loader(files=paths, batch_size=256, size=(224, 224), shuffle=True)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:      # {"image": uint8 [N,3,H,W], "index": int64 [N], ...}
                ...

Needs grpcio, protobuf, numpy and torch only (no PyAV, no prometheus-client).
"""

from .errors import FeedError
from .feed import FeedClient
from .fields import Field, metadata, split
from .loader import Loader
from .mixing import cutmix, mixup

__all__ = ["FeedClient", "FeedError", "Field", "Loader", "cutmix", "metadata", "mixup", "split"]
