"""The plugin API: a plugin does ``from gpufeed.server import transforms`` and registers.

A plugin registers with ``@transforms.register(name)``; the registry's text
(media/transforms/registry.py) says what a factory and its sample function
take and return. This module only names the registry at the path plugins import,
so that the path stays the same when the server's own modules move.
"""

from .media.transforms.registry import (
    MAX_PARAMS_CHARS,
    Registered,
    SampleFn,
    TransformError,
    load,
    lookup,
    names,
    parse_params,
    register,
)

__all__ = ["MAX_PARAMS_CHARS", "Registered", "SampleFn", "TransformError", "load", "lookup",
           "names", "parse_params", "register"]
