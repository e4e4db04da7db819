"""Running a stream: a plan's batches decoded into slots and published in order.

- ``stream``: one stream's slots leased to batches, filled and published in order.
- ``sources``: where a stream's batches come from: its own pass or a shared job's.
- ``pool``: the decode threads, serving the open streams in turn.
"""
