"""The gRPC edge: the only serving code that knows gRPC's calls and status codes.

- ``service``: the servicer (Info, Stream); admits, plans and runs each stream,
  and maps the server's exceptions to status codes.
- ``calls``: bounds on calls that hold a worker thread idle (it ends them, each with
  its status code).
- ``watchdog``: deadlines that end a blocked call.
- ``wire``: inline batches written onto the wire with one copy.
"""
