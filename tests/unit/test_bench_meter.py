"""The benchmark's meter times the steady state: from the warm-up's last batch to the last batch.

What happens after the last batch (a loader that stalls at the end of its
sequence, as tf.data can for seconds, workers and servers shutting down) is
reported apart and never counted in a row's images/s or CPU per image.
"""

from __future__ import annotations

import time

from bench.measure import Meter
from bench.peers.remote import _LinkMeter


def _burn_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_stall_after_the_last_batch_is_teardown_not_throughput():
    meter = Meter("row", 40, warmup=2, log=lambda line: None)
    meter.batch(8)
    before_clock = time.monotonic()
    for _ in range(4):
        meter.batch(8)  # the second starts the clock
    after_last = time.monotonic()
    _burn_cpu(0.3)  # the loader "stalls" at the end of its sequence, spending CPU
    meter.stop()
    result = meter.result("note")

    assert (result.images, result.expected, result.measured_images) == (40, 40, 24)
    # The window lies between the warm-up's last batch and the last batch, nothing after.
    assert 0 < result.seconds <= after_last - before_clock
    assert result.end_of_sequence_seconds >= 0.3
    assert result.teardown_seconds >= result.end_of_sequence_seconds
    assert result.startup_seconds >= 0
    # Nor is the stall's CPU in the window (CPU is counted in 10 ms ticks).
    assert result.cpu_seconds < 0.15
    assert result.images_per_second == 24 / result.seconds


class _FakeLink:
    """A shaped link whose server side has sent 1000 bytes more at every reading."""

    rate, rate_bits = "1gbit", 1e9

    def __init__(self):
        self.sent = 0

    def server_tx_bytes(self) -> int:
        self.sent += 1000
        return self.sent


def test_a_link_row_shorter_than_the_warm_up_reports_what_it_can():
    """`--images 48` at the default batch size is one batch, under a warm-up of 3: the
    network-hop rows must still report (no window, so no rates), not raise."""
    meter = Meter("row", 48, warmup=3, log=lambda line: None)
    link = _LinkMeter(meter, _FakeLink(), image_bytes=3 * 8 * 8)
    link.batch(48)
    link.stop()
    note, extra = link.figures()
    assert extra == {"link": "1gbit"}
    assert "no link figures" in note and "warm-up of 3" in note
    assert meter.result(note).images == 48


def test_a_link_row_reports_its_window_rates():
    meter = Meter("row", 40, warmup=2, log=lambda line: None)
    link = _LinkMeter(meter, _FakeLink(), image_bytes=3 * 8 * 8)
    for _ in range(5):
        link.batch(8)  # the second starts the window
    link.stop()
    _, extra = link.figures()
    assert extra["link_bytes_per_second"] > 0 and extra["image_bytes_per_second"] > 0
    assert extra["link_utilisation"] == 8 * extra["link_bytes_per_second"] / 1e9
