"""The benchmark's meter times the steady state: from the warm-up's last batch to the last batch.

What happens after the last batch (a loader that stalls at the end of its
sequence, as tf.data can for seconds, workers and servers shutting down) is
reported apart and never counted in a row's images/s or CPU per image.
"""

from __future__ import annotations

import time

from bench.measure import Meter


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
