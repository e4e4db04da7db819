"""gpufeed inline to a trainer across a network hop (bench.netns): images/s and link use.

The server runs in one network namespace, listening on ``netns.SERVER_ADDRESS``;
this process moves into the other before it opens a channel and is the
trainer, over ``inline`` (the only transport across hosts). The link is a veth
pair, unshaped or shaped with tbf to ``rate``. Besides images/s, the row
reports the link's utilisation over the measured window: bytes the server's
end sent (TCP/IP headers included, as a NIC counts them) over what the rate
allows in that time, and the batches' payload alone.
"""

from __future__ import annotations

import time

from . import Unavailable


def run(config, meter, rate: str | None, **options) -> tuple[str, dict]:
    from .. import netns

    reason = netns.unavailable_reason()
    if reason:
        raise Unavailable(reason)
    with netns.VethLink(rate) as link:
        netns.enter(link.client_ns)  # before gRPC starts a thread or opens a socket
        from gpufeed.client import FeedClient
        from gpufeed.server.process import ServerProcess

        args = ["--data-root", config.root, "--threads", str(config.threads),
                "--listen", f"{netns.SERVER_ADDRESS}:0"]
        window = []  # (time, server tx bytes, payload bytes) at the clock's start and end
        payload = 0
        with ServerProcess(args, prefix=link.server_command([])) as server, \
                FeedClient(server.address) as feed:
            loader = feed.loader(files=config.list_file, batch_size=config.batch_size,
                                 size=tuple(config.size), transport="inline", **options)
            batches = 0
            for epoch in range(config.passes):
                loader.set_epoch(epoch)
                for batch in loader:
                    payload += sum(t.nbytes for t in batch.values())
                    meter.batch(int(batch["image"].shape[0]))
                    batches += 1
                    if batches == config.warmup:
                        window.append((time.perf_counter(), link.server_tx_bytes(), payload))
            meter.stop()
            window.append((time.perf_counter(), link.server_tx_bytes(), payload))
    (t0, tx0, p0), (t1, tx1, p1) = window[0], window[-1]
    seconds = max(t1 - t0, 1e-9)
    extra = {"link": rate or "veth, unshaped", "link_bytes_per_second": (tx1 - tx0) / seconds,
             "payload_bytes_per_second": (p1 - p0) / seconds}
    note = (f"inline across a veth link ({extra['link']}): "
            f"{extra['link_bytes_per_second'] / 1e6:.0f} MB/s on the wire")
    if rate:
        extra["link_utilisation"] = 8 * extra["link_bytes_per_second"] / link.rate_bits
        extra["payload_utilisation"] = 8 * extra["payload_bytes_per_second"] / link.rate_bits
        note += (f", {100 * extra['link_utilisation']:.0f}% of the link "
                 f"({100 * extra['payload_utilisation']:.0f}% as batch payload)")
    return note, extra
