"""One module per row of the table. Each has ``run(config, meter) -> str`` (a note).

``config`` is a ``bench.worker.Config``: the files, batch size, output size,
passes and thread counts every row shares. A row that needs a package which
is not installed raises ``Unavailable`` and the table says so.
"""


class Unavailable(Exception):
    """The row's package is not installed; the message says which."""
