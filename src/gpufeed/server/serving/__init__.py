"""Serving: from a StreamRequest to the last batch of a stream, in three subpackages.

Imports run edge -> running -> planning, never back; all three use the two
modules here, which import none of them.

- ``edge``: the gRPC edge: the servicer, the bounds on its calls, the wire.
- ``planning``: a request checked into a plan: names, lists, order, layout.
- ``running``: a planned stream run: its batches' source, slots and decode pool.
- ``errors``: what refuses a request or ends a stream, in the serving code's terms.
- ``failures``: a failed sample's category and detail, sent in its batch.
"""
