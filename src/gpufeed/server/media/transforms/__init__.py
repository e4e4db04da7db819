"""Sample transforms: named, registered by plugins, run on each decoded row.

- ``registry``: the named transforms plugins register and requests ask for, and
  the checks on their parameters (plugins import it as ``gpufeed.server.transforms``).
- ``runner``: a stream's transforms, made at open and run per sample, on the decode
  thread or in worker processes.
- ``builtins``: the built-in augmentations, registered as a plugin like any other.
"""
