"""Serving: from a StreamRequest to the last batch of a stream.

The gRPC servicer and the bounds on its calls; a request checked into a plan;
the sample order; a stream's own pass or a shared job's; the decode pool;
inline batches onto the wire.
"""
