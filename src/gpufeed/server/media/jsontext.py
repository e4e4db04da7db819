"""JSON from outside the server (sidecar files, request parameters), parsed within a depth.

Python's parser recurses once per level of nesting: a document of 100,000
opening brackets ends in RecursionError, which is no ValueError and would
surface as a server bug (a sample failed as ``internal``, a request answered
UNKNOWN with a traceback). ``loads`` turns that into the ValueError any other
malformed document gives, and refuses documents deeper than ``MAX_DEPTH``
levels as well, so that code walking a parsed value (a plugin, a message
quoting it) never recurses far. Bounding a document's size, and so the time
its parse holds the GIL, is the caller's: it knows what the document is for.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "loads"]

# Levels of nested lists and objects a document may have: far more than a parameter, a
# box list (2) or metadata needs, far fewer than Python's recursion limit.
MAX_DEPTH = 32


def loads(text: str | bytes) -> Any:
    """``text`` parsed; ValueError saying why if it is not JSON (bytes: not UTF-8 either)
    or nests lists and objects deeper than ``MAX_DEPTH`` levels."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    level = [value] if isinstance(value, (list, dict)) else []
    for _ in range(MAX_DEPTH):
        level = [child for container in level
                 for child in (container.values() if isinstance(container, dict) else container)
                 if isinstance(child, (list, dict))]
        if not level:
            return value
    raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
