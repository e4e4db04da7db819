"""gpufeed's trainer-side library.

    from gpufeed.client import FeedClient, Output

    with FeedClient("localhost:50051") as feed:
        train = Output(size=224, resize="random_resized_crop", flip=0.5)
        loader = feed.loader(paths, batch_size=256, output=train, shuffle=True)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:      # {"image": uint8 [N,3,H,W], "index": int64 [N], ...}
                ...

Needs grpcio, protobuf, numpy and torch only (no PyAV, no prometheus-client).
"""

from .errors import FeedError
from .failures import SampleFailure
from .feed import FeedClient
from .fields import Field, metadata, names, split
from .loader import Loader
from .mixing import cutmix, mixup
from .output import Output

__all__ = ["FeedClient", "FeedError", "Field", "Loader", "Output", "SampleFailure", "cutmix",
           "metadata", "mixup", "names", "split"]
