"""The gRPC edge: the only serving code that knows gRPC's calls and status codes.

- ``service``: the servicer (Info, Stream); admits, plans and runs each stream,
  and picks every status code.
- ``calls``: bounds on calls that hold a worker thread idle.
- ``watchdog``: deadlines that end a blocked call.
- ``wire``: inline batches written onto the wire with one copy.
"""
