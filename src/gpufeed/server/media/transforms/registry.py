"""Named sample transforms: what a plugin registers and a request asks for by name.

A plugin is a Python module the operator names with ``gpufeed-server --plugins
mypkg.transforms``; importing it registers its transforms::

    import numpy as np
    from gpufeed.server import transforms

    @transforms.register("posterize")
    def posterize(bits: int = 4):            # the parameters a request may give
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {bits}")
        mask = 0xFF << (8 - bits) & 0xFF

        def apply(sample, rng):               # per sample, on a decode thread
            np.bitwise_and(sample["image"], mask, out=sample["image"])
            return sample

        return apply

A registered function is a *factory*: the server calls it once when a stream
opens, with the request's parameters as keyword arguments, and it returns the
per-sample function. So parameters are checked once, before any sample is
decoded, by ordinary Python code: an unknown parameter, a value of the wrong
type (checked against the factory's annotations: ``int``, ``float``, ``bool``,
``str``, or a list of those) or a ``ValueError``/``TypeError`` the factory
raises refuses the request with INVALID_ARGUMENT naming the transform. Clients
send names and JSON values only, never code.

Before any factory sees them, parameters are bounded here, the same for every
transform: at most ``MAX_PARAMS_CHARS`` characters of JSON (what parsing and
checking them may cost the server), nested at most ``jsontext.MAX_DEPTH``
levels, and every number in them finite and, if an integer, within 64 bits
(what ``float()`` and numpy take without overflowing). A factory still checks
its own ranges; one that overflows (``ArithmeticError``) refuses the request
as a ``ValueError`` does.

The per-sample function gets the sample's fields, a dict of name -> numpy array
(``image`` is the decoded uint8 [3, H, W] row, after the crop and flip; ``mask``,
``boxes``, ``meta`` when the request has those fields: media/fields.py), and a
``numpy.random.Generator`` seeded by (seed, epoch, sample index, the
transform's place in the request): all its randomness must come from it, so that
a pass is reproducible and resumes exactly. It returns the dict, its arrays
changed in place or replaced by arrays (or tensors) of the same shape and dtype.

``holds_gil=True`` says the transform is pure Python that holds the GIL (loops
over pixels): the server then runs it in a small process pool instead of on the
decode threads, which would only take turns at it. numpy and torch release the
GIL in their kernels; leave the flag off for them (bench/RESULTS.md, "Sample
transforms", has the two measured).

``moves_image=True`` says the transform moves the image's pixels (rotate, shear,
translate) without moving the other fields: a request that also has a ``mask``
or ``boxes`` field is refused at open, since its masks and boxes would no longer
match the image. A geometric transform that moves every field itself leaves the
flag off.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import jsontext

__all__ = ["MAX_PARAMS_CHARS", "Registered", "SampleFn", "TransformError", "load", "lookup",
           "names", "parse_params", "register"]

# The fields of one sample: name -> array ("image": uint8 [3, H, W]).
Fields = dict[str, typing.Any]
# What a factory returns: the transform of one sample.
SampleFn = Callable[[Fields, np.random.Generator], Fields]

# Modules every server loads: the built-in augmentations are plugins too.
BUILT_IN = ("gpufeed.server.media.transforms.builtins",)

# A transform's parameters, as JSON text: room for a lookup table of a few thousand
# numbers, while parsing and checking the most a request may send stays milliseconds.
MAX_PARAMS_CHARS = 64 * 1024
# Integers a parameter may hold: numpy's int64 (float() takes them all as well).
_INT64 = (-(1 << 63), 1 << 63)


class TransformError(ValueError):
    """A transform a request cannot have (unknown name, bad parameters); names it."""


@dataclass(frozen=True)
class Registered:
    """A registered transform: its name, factory, whether it holds the GIL, and whether it
    moves the image alone."""

    name: str
    factory: Callable[..., SampleFn]
    holds_gil: bool
    module: str
    moves_image: bool = False

    def make(self, params: dict) -> SampleFn:
        """The per-sample function for ``params``; TransformError naming what is wrong."""
        accepted = _parameters(self.factory)
        for key, value in params.items():
            if key not in accepted:
                raise TransformError(f"{self.name!r} has no parameter {key!r} (it takes: "
                                     f"{', '.join(accepted) or 'none'})")
            _check_type(self.name, key, value, accepted[key])
            if not _numbers_fit(value):
                raise TransformError(f"{self.name!r}: parameter {key!r} must hold finite "
                                     f"numbers (integers within 64 bits), got {_shown(value)}")
        try:
            fn = self.factory(**params)
        except (TypeError, ValueError, ArithmeticError) as e:
            raise TransformError(f"{self.name!r}: {e}") from None
        if not callable(fn):
            raise TransformError(f"{self.name!r}: its factory returned {type(fn).__name__}, "
                                 f"not a function of (sample, rng)")
        return fn


_registry: dict[str, Registered] = {}
_loaded: list[str] = []


def register(name: str, *, holds_gil: bool = False, moves_image: bool = False
             ) -> Callable[[Callable[..., SampleFn]], Callable[..., SampleFn]]:
    """Register the decorated factory as the transform ``name`` (see the module's text)."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"a transform name is letters, digits and underscores, got {name!r}")

    def decorate(factory: Callable[..., SampleFn]) -> Callable[..., SampleFn]:
        known = _registry.get(name)
        if known is not None and known.factory.__qualname__ != factory.__qualname__:
            raise ValueError(f"transform {name!r} is registered twice ({known.module} and "
                             f"{factory.__module__})")
        _registry[name] = Registered(name, factory, holds_gil, factory.__module__, moves_image)
        return factory

    return decorate


def load(modules: Iterable[str] = ()) -> list[str]:
    """Import the built-ins and ``modules`` (each registers its transforms); the names
    now registered. ImportError (or the module's own error) if one cannot be imported."""
    for module in (*BUILT_IN, *modules):
        importlib.import_module(module)
        if module not in _loaded:
            _loaded.append(module)
    return names()


def loaded_modules() -> tuple[str, ...]:
    """The modules ``load`` imported: what a worker process imports to have the same
    transforms."""
    return tuple(_loaded)


def names() -> list[str]:
    return sorted(_registry)


def lookup(name: str) -> Registered:
    """The transform ``name``; TransformError listing what there is if there is none."""
    if not _loaded:  # a server embedded without FeedServer still has the built-ins
        load()
    found = _registry.get(name)
    if found is None:
        raise TransformError(f"unknown transform {name!r} (this server has: "
                             f"{', '.join(names()) or 'none'}; operators add more with "
                             f"gpufeed-server --plugins)")
    return found


def parse_params(name: str, params_json: str) -> dict:
    """A request's parameters: a JSON object of at most ``MAX_PARAMS_CHARS`` characters,
    nested at most ``jsontext.MAX_DEPTH`` levels; TransformError if it is not one."""
    if not params_json:
        return {}
    if len(params_json) > MAX_PARAMS_CHARS:
        raise TransformError(f"{name!r}: parameters are {len(params_json)} characters of JSON, "
                             f"over the {MAX_PARAMS_CHARS} a transform's parameters may take")
    try:
        params = jsontext.loads(params_json)
    except ValueError as e:
        raise TransformError(f"{name!r}: parameters are not JSON: {e}") from None
    if not isinstance(params, dict):
        raise TransformError(f"{name!r}: parameters must be a JSON object, got "
                             f"{type(params).__name__}")
    return params


def _parameters(factory: Callable) -> dict[str, object]:
    """The factory's keyword parameters and their annotated types (None: unchecked)."""
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # an annotation that does not resolve: check nothing
        hints = {}
    return {p.name: hints.get(p.name) for p in inspect.signature(factory).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_type(name: str, key: str, value: object, hint: object) -> None:
    if hint is None or _fits(value, hint):
        return
    raise TransformError(f"{name!r}: parameter {key!r} must be {_describe(hint)}, got "
                         f"{_shown(value)}")


def _numbers_fit(value: object) -> bool:
    """Whether every number in ``value`` (lists and objects searched) is finite and, if an
    integer, within int64: NaN, Infinity, 1e999 and 10**400 are not."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, int) and not _INT64[0] <= item < _INT64[1]:
            return False
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return True


def _shown(value: object, limit: int = 80) -> str:
    """``value`` as JSON for a message, cut to about ``limit`` characters."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _fits(value: object, hint: object) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in typing.get_args(hint))
    if origin in (list, tuple, Sequence, Iterable) or hint in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value) \
            if args else isinstance(value, list)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # Any, TypeVars, ...: the factory checks


def _describe(hint: object) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(hint))
    if origin is not None:
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a list of ({_describe(args[0])})" if args else "a list"
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))
