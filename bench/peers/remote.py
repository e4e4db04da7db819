"""Trainers across a network hop (bench.netns): images/s and the link's utilisation.

The server (gpufeed, or the tf.data service's dispatcher and worker) runs in
one network namespace, serving on ``netns.SERVER_ADDRESS``; this process
moves into the other before it opens a channel and is the trainer: gpufeed
over ``inline`` (the only transport across hosts), or tf.data service's
``distribute``. The link is a veth pair, unshaped or shaped with tbf to
``rate``. Besides images/s, the row reports over the measured window (the
same batches the meter times) the bytes the server's end sent, TCP/IP headers
included as a NIC counts them, and with a rate the link's utilisation: those
bytes over what the rate allows in that time, and the images' bytes alone.
"""

from __future__ import annotations

import time

from . import Unavailable
from .gpufeed import measure


class _LinkMeter:
    """The row's meter, plus the server's transmitted bytes at the clock's start and end."""

    def __init__(self, meter, link, image_bytes: int):
        self._meter = meter
        self._link = link
        self._image_bytes = image_bytes
        self._batches = 0
        self.start = self.end = None  # (time, server tx bytes, images)

    @property
    def images(self) -> int:
        return self._meter.images

    def batch(self, size: int) -> None:
        self._meter.batch(size)
        self._batches += 1
        if self._batches == self._meter.warmup:
            self.start = (time.perf_counter(), self._link.server_tx_bytes(), self._meter.images)

    def stop(self) -> None:
        self._meter.stop()
        if self.end is None:
            self.end = (time.perf_counter(), self._link.server_tx_bytes(), self._meter.images)

    def figures(self) -> tuple[str, dict]:
        """(note, extra fields) of the row: the link's rates over the measured window;
        only the link's name when a short run has no window (as the meter's own
        figures: fewer batches than the warm-up)."""
        link = self._link
        extra = {"link": link.rate or "veth, unshaped"}
        if self.start is None or self.end is None:
            return (f"{extra['link']}: no link figures, {self._batches} batches, fewer than "
                    f"the warm-up of {self._meter.warmup}"), extra
        (t0, tx0, n0), (t1, tx1, n1) = self.start, self.end
        seconds = max(t1 - t0, 1e-9)
        extra.update(link_bytes_per_second=(tx1 - tx0) / seconds,
                     image_bytes_per_second=(n1 - n0) * self._image_bytes / seconds)
        note = f"{extra['link']}: {extra['link_bytes_per_second'] / 1e6:.0f} MB/s on the wire"
        if link.rate:
            extra["link_utilisation"] = 8 * extra["link_bytes_per_second"] / link.rate_bits
            extra["image_utilisation"] = 8 * extra["image_bytes_per_second"] / link.rate_bits
            note += (f", {100 * extra['link_utilisation']:.0f}% of the link "
                     f"({100 * extra['image_utilisation']:.0f}% as image bytes)")
        return note, extra


def _link(rate: str | None):
    from .. import netns

    reason = netns.unavailable_reason()
    if reason:
        raise Unavailable(reason)
    return netns.VethLink(rate)


def run(config, meter, job: str, rate: str | None, peer: str = "gpufeed") -> tuple[str, dict]:
    """``peer`` ("gpufeed", or "tf" for the tf.data service) serving in one namespace,
    this process its trainer in the other; the squash job (bench.jobs) only."""
    from .. import netns

    if job != "squash":
        raise ValueError(f"the link rows do the squash job, not {job!r}")
    with _link(rate) as link:
        netns.enter(link.client_ns)  # before gRPC or TensorFlow starts a thread
        height, width = config.size
        link_meter = _LinkMeter(meter, link, 3 * height * width)
        if peer == "tf":
            from . import tfdata

            tfdata.run(config, link_meter, job, True, prefix=link.server_command([]),
                       host=netns.SERVER_ADDRESS)
            what = "tf.data service"
        else:
            _gpufeed(config, link_meter, link)
            what = "inline"
        note, extra = link_meter.figures()
    return f"{what} across a veth link ({note})", extra


def _gpufeed(config, meter: _LinkMeter, link) -> None:
    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    from .. import netns

    args = ["--data-root", config.root, "--threads", str(config.threads),
            "--listen", f"{netns.SERVER_ADDRESS}:0"]
    with ServerProcess(args, prefix=link.server_command([])) as server, \
            FeedClient(server.address) as feed:
        loader = feed.loader(files=config.list_file, batch_size=config.batch_size,
                             size=tuple(config.size), transport="inline")
        measure(loader, config, meter)
