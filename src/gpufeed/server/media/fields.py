"""A sample's fields beside its image: a mask, boxes and metadata, read from sidecar files.

A request declares each field (``StreamRequest.fields``) with the naming rule
of its sidecar: the sample's path with its suffix replaced (``cat.jpg`` ->
``cat.png``), optionally in a parallel tree (the last directory below the
data root named ``tree_from`` renamed ``tree_to``: ``images/a/cat.jpg`` ->
``masks/a/cat.png``). A sidecar is located and read under the data roots as a
sample is (storage/paths.py), so it can never be outside them; one that is
missing, unreadable or malformed fails its sample, not the stream.

Each field follows the image's crop box and flip, on the decode thread, after
the image's row is written. What a sample's fields look like then (what a
per-sample transform may work on) is ``Sample``: a dict of numpy arrays,
``image`` uint8 [3, H, W] (the row itself), ``mask`` uint8 [H, W], ``boxes``
float32 [k, 5] (x0, y0, x1, y1, class, output pixels), ``meta`` uint8 [n]
(the sidecar's JSON, utf-8).

- mask: an 8-bit grayscale or palette PNG (any allowed image format) of the
  image's size, whose pixel values are class ids, cropped and resized as
  Pillow's NEAREST resize does on the same box (each output pixel takes the
  source pixel under its centre, the centres stepped by box / output), flipped.
- boxes: a ``.json`` list of ``[x0, y0, x1, y1, class]`` lists, or any other
  suffix as text, one ``x0 y0 x1 y1 class`` line per box (blank lines and
  ``#`` comments skipped), in source pixels. Each is mapped through the crop
  box to output pixels, clipped to the output window, and dropped when
  nothing of it is left inside (zero width or height after clipping);
  flipped with the image (x0' = W - x1, x1' = W - x0).
- meta: any JSON document, checked to parse, passed through as its bytes.

A field's file is bounded by its ``max_items`` before it is read (a sidecar
larger is refused by its size, a shard member before it is parsed), and a
sample over the bound fails as ``too_large``: metadata at ``max_items`` bytes;
boxes at ``max_items`` boxes of ``_TEXT_BOX_BYTES`` (a line of five numbers as
long as float64 prints them, ~125 characters) or ``_JSON_BOX_BYTES`` (a box
list pretty-printed, one number a line) each, and ``_HEADER_BYTES`` for a
header and comments. Parsing stops at ``max_items + 1`` boxes; a JSON box
list is counted by its brackets and commas before it is parsed, so that the
parse, which holds the GIL, has at most ``max_items`` boxes' numbers to read.
JSON is parsed within a depth (jsontext.py): too deep, like malformed, fails
the sample as ``undecodable`` (``meta: not JSON: ...``).

Variable-length fields travel flat with offsets: a batch's ``boxes`` is
float32 [N, 5] with ``boxes_offsets`` int64 [B + 1] (sample i's boxes are
``boxes[offsets[i]:offsets[i + 1]]``), ``meta`` uint8 [M] with
``meta_offsets``. In the slot each row has room for ``max_items`` (the
request's per-field cap, which sets the batch's size); the batch's last
thread packs the rows together (``SampleFields.pack``) before it is sent.
"""

from __future__ import annotations

import io
import math
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gpufeed.v1 import feed_pb2

from ..storage.paths import FileTooLarge
from . import jsontext
from .decode import DecodeError, OverLimit, SourceWindow, decode_frame, plane_rows

__all__ = ["BOXES", "FIELD_NAMES", "MASK", "META", "FieldError", "Sample", "SampleFields",
           "Sidecar", "nearest_window", "pack_rows", "row_sample"]

MASK, BOXES, META = "mask", "boxes", "meta"
FIELD_NAMES = (MASK, BOXES, META)
_SUFFIX = {MASK: ".png", BOXES: ".txt", META: ".json"}
# Per-sample room when the request says 0, and the most a request may ask for.
_DEFAULT_ITEMS = {BOXES: 256, META: 4096}
_MAX_ITEMS = {BOXES: 1 << 16, META: 1 << 20}
_VARIABLE = (BOXES, META)
_BOX_COLUMNS = 5  # x0, y0, x1, y1, class
# The bytes a boxes file may take per box, and for a header and comments: see above.
_TEXT_BOX_BYTES, _JSON_BOX_BYTES, _HEADER_BYTES = 128, 256, 4096
# Brackets and commas a JSON box list may have beyond its boxes' own (_json_rows).
_SPARE_TOKENS = 1024
_MASK_FORMATS = ("gray", "pal8")  # pixel formats whose values are the stored indices

# One sample's arrays by field name, after the crop and flip (see the module docstring).
Sample = dict[str, np.ndarray]


class FieldError(ValueError):
    """A field declaration the server refuses; the message names ``fields[i]``."""


@dataclass(frozen=True)
class Sidecar:
    """Where a field's file is, from the sample's path."""

    field: str
    suffix: str
    tree_from: str = ""
    tree_to: str = ""

    def path(self, sample: str, root: str | None) -> str:
        """The sidecar's path for a located sample path under ``root`` (None: unknown).

        Only directories below the root are renamed: a root that happens to be
        called ``images`` is left alone.
        """
        directory, name = posixpath.split(sample)
        stem = posixpath.splitext(name)[0]
        if self.tree_from:
            base = root.rstrip("/") if root and directory.startswith(root) else ""
            parts = directory[len(base):].split("/")
            if self.tree_from not in parts:
                raise DecodeError(f"{self.field}: no directory {self.tree_from!r} in the sample's "
                                  f"path to rename {self.tree_to!r}")
            at = len(parts) - 1 - parts[::-1].index(self.tree_from)
            parts[at] = self.tree_to
            directory = base + "/".join(parts)
        return posixpath.join(directory, stem + self.suffix)


def _checked_name(spec: feed_pb2.FieldSpec, at: str) -> str:
    if spec.name not in FIELD_NAMES:
        raise FieldError(f"{at}.name: {spec.name!r} is not a field; one of "
                         f"{', '.join(FIELD_NAMES)}")
    return spec.name


def _checked_sidecar(spec: feed_pb2.FieldSpec, at: str) -> Sidecar:
    suffix = spec.suffix or _SUFFIX[spec.name]
    if not suffix.startswith(".") or "/" in suffix or "\0" in suffix or suffix.strip(".") == "":
        raise FieldError(f"{at}.suffix: {spec.suffix!r} must be a file suffix such as "
                         f"{_SUFFIX[spec.name]!r} (a dot, no '/')")
    if bool(spec.tree_from) != bool(spec.tree_to):
        raise FieldError(f"{at}.tree_from/tree_to: give both directory names or neither, got "
                         f"{spec.tree_from!r} and {spec.tree_to!r}")
    for key in ("tree_from", "tree_to"):
        value = getattr(spec, key)
        if value and ("/" in value or "\0" in value or value in (".", "..")):
            raise FieldError(f"{at}.{key}: {value!r} must be one directory name")
    return Sidecar(spec.name, suffix, spec.tree_from, spec.tree_to)


class SampleFields:
    """A stream's declared fields: their place in a batch, reading, and packing.

    ``ValueError`` (``FieldError``) at construction names the field at fault.
    """

    def __init__(self, specs: Iterable[feed_pb2.FieldSpec], height: int, width: int):
        self.height, self.width = height, width
        self.sidecars: dict[str, Sidecar] = {}
        self.max_items: dict[str, int] = {}
        for i, spec in enumerate(specs):
            at = f"fields[{i}]"
            name = _checked_name(spec, at)
            if name in self.sidecars:
                raise FieldError(f"{at}.name: {name!r} is declared twice")
            self.sidecars[name] = _checked_sidecar(spec, at)
            if name == MASK:
                if spec.max_items:
                    raise FieldError(f"{at}.max_items: a mask has the image's size; give 0")
                continue
            items = spec.max_items or _DEFAULT_ITEMS[name]
            if not 0 < items <= _MAX_ITEMS[name]:
                raise FieldError(f"{at}.max_items: must be in 0..{_MAX_ITEMS[name]} "
                                 f"({'boxes' if name == BOXES else 'bytes'} per sample; 0: "
                                 f"{_DEFAULT_ITEMS[name]}), got {spec.max_items}")
            self.max_items[name] = items
        self._index = {name: i for i, name in enumerate(self.sidecars)}

    def declared_at(self, name: str) -> str:
        """The request field that declared ``name``, for messages."""
        return f"fields[{self._index[name]}]"

    def arrays(self) -> tuple[list[tuple], tuple[str, ...], tuple[str, ...]]:
        """(layout arrays, private names, offsets names) of the fields in a batch."""
        arrays: list[tuple] = []
        private: list[str] = []
        offsets: list[str] = []
        for name in self.sidecars:
            if name == MASK:
                arrays.append((MASK, np.uint8, (self.height, self.width)))
                continue
            row = (self.max_items[name], _BOX_COLUMNS) if name == BOXES else \
                (self.max_items[name],)
            arrays += [(name, np.float32 if name == BOXES else np.uint8, row),
                       (f"{name}_offsets", np.int64, ()), (f"{name}_count", np.int64, ())]
            private.append(f"{name}_count")
            offsets.append(f"{name}_offsets")
        return arrays, tuple(private), tuple(offsets)

    def read(self, storage, path: str, image: np.ndarray, window: SourceWindow, flip: bool,
             max_pixels: int) -> Sample:
        """The sample, its ``image`` row written, with its fields from its sidecar files
        after the crop and flip; a mask over ``max_pixels`` (--max-pixels), or boxes or
        metadata over ``max_bytes``, is refused before it is decoded (read)."""
        return self.convert({name: self._sidecar(storage, path, sidecar)
                             for name, sidecar in self.sidecars.items()}, image, window, flip,
                            max_pixels)

    def max_bytes(self, name: str) -> int | None:
        """The largest file field ``name`` may have (None: the mask, bounded by
        --max-file-bytes and --max-pixels)."""
        if name == BOXES:
            return self.max_items[BOXES] * self._box_bytes() + _HEADER_BYTES
        return self.max_items[META] if name == META else None

    def check_size(self, name: str, size: int) -> None:
        """OverLimit when field ``name``'s file of ``size`` bytes is larger than the field
        may take (a tar shard's member is checked so before it is read)."""
        limit = self.max_bytes(name)
        if limit is not None and size > limit:
            raise OverLimit(f"{name}: {size} bytes, over {self._bound(name)}")

    def _box_bytes(self) -> int:
        return _JSON_BOX_BYTES if _is_json(self.sidecars[BOXES]) else _TEXT_BOX_BYTES

    def _bound(self, name: str) -> str:
        """Field ``name``'s byte limit and what sets it, for messages."""
        at = f"{self.declared_at(name)}.max_items"
        if name == META:
            return f"the {self.max_items[META]} bytes per sample that {at} allows"
        return (f"the {self.max_bytes(name)} bytes that {self.max_items[BOXES]} boxes may take "
                f"({at}; {self._box_bytes()} bytes a box and {_HEADER_BYTES} more)")

    def convert(self, files: dict[str, bytes], image: np.ndarray, window: SourceWindow, flip: bool,
                max_pixels: int) -> Sample:
        """The sample with its fields from their files' bytes (sidecars, or a shard's
        members)."""
        sample: Sample = {"image": image}
        for name, data in files.items():
            self.check_size(name, len(data))
            if name == MASK:
                sample[MASK] = self._mask(data, window, flip, max_pixels)
            elif name == BOXES:
                sample[BOXES] = self._boxes(data, window, flip)
            else:
                sample[META] = self._meta(data)
        return sample

    def _sidecar(self, storage, path: str, sidecar: Sidecar) -> bytes:
        """A sidecar's bytes; one larger than its field's ``max_bytes`` is refused unread."""
        located = storage.locate(sidecar.path(path, storage.root_of(path)))
        if located == path:
            raise DecodeError(f"{sidecar.field}: the sidecar {sidecar.suffix!r} is the sample "
                              f"itself")
        limit = self.max_bytes(sidecar.field)
        ours = limit is not None and limit < storage.max_file_bytes
        try:
            return storage.read(located, limit if ours else None)
        except FileTooLarge as e:
            why = f" is larger than {self._bound(sidecar.field)}" if ours else f": {e}"
            raise OverLimit(f"{sidecar.field}: sidecar {storage.shown(located)}{why}") from None
        except FileNotFoundError:  # no errno: the message is the failure's (not_found) detail
            raise FileNotFoundError(f"{sidecar.field}: sidecar {storage.shown(located)} not found"
                                    ) from None
        except OSError as e:
            raise DecodeError(f"{sidecar.field}: sidecar {storage.shown(located)}: {e}") from None

    def write(self, sample: Sample, arrays: dict[str, np.ndarray], row: int) -> None:
        """Write a sample's fields into its row of the batch."""
        for name, values in sample.items():
            if name in _VARIABLE:
                arrays[name][row, :len(values)] = values
                arrays[f"{name}_count"][row] = len(values)
            elif name != "image":
                arrays[name][row] = values

    def pack(self, arrays: dict[str, np.ndarray], rows: int) -> dict[str, int]:
        """Pack the variable-length fields of the first ``rows`` rows (failed rows already
        closed up) flat from each field's start, and fill their offsets. Returns how
        many of each field's first-axis entries are sent (fields.py's tensors)."""
        lengths: dict[str, int] = {}
        for name in _VARIABLE:
            if name in self.sidecars:
                lengths.update(pack_rows(arrays, name, rows))
        return lengths

    def _mask(self, data: bytes, window: SourceWindow, flip: bool, max_pixels: int) -> np.ndarray:
        frame = decode_frame(data, max_pixels)
        if frame.format.name not in _MASK_FORMATS:
            raise DecodeError(f"mask: class ids need an 8-bit grayscale or palette image, got "
                              f"{frame.format.name}")
        if (frame.height, frame.width) != (window.src_h, window.src_w):
            raise DecodeError(f"mask: {frame.width}x{frame.height}, but the image is "
                              f"{window.src_w}x{window.src_h}")
        ids = plane_rows(frame.planes[0], frame.height)
        return nearest_window(ids[:, :frame.width], window.box, self.height, self.width, flip)

    def _boxes(self, data: bytes, window: SourceWindow, flip: bool) -> np.ndarray:
        limit = self.max_items[BOXES]
        boxes = _parse_boxes(data, _is_json(self.sidecars[BOXES]), limit)
        if boxes is None:
            raise OverLimit(f"boxes: more than the {limit} boxes per sample that "
                            f"{self.declared_at(BOXES)}.max_items allows")
        top, left, h, w = window.box
        sx, sy = self.width / w, self.height / h
        out = np.empty((len(boxes), _BOX_COLUMNS), np.float64)
        out[:, [0, 2]] = np.clip((boxes[:, [0, 2]] - left) * sx, 0, self.width)
        out[:, [1, 3]] = np.clip((boxes[:, [1, 3]] - top) * sy, 0, self.height)
        out[:, 4] = boxes[:, 4]
        out = out[(out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])]
        if flip:
            out[:, [0, 2]] = self.width - out[:, [2, 0]]
        return out.astype(np.float32)

    @staticmethod
    def _meta(data: bytes) -> np.ndarray:
        try:
            jsontext.loads(data)
        except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, too deep alike
            raise DecodeError(f"meta: not JSON: {e}") from None
        return np.frombuffer(data, np.uint8)


def pack_rows(arrays: dict[str, np.ndarray], name: str, rows: int) -> dict[str, int]:
    """Pack variable-length ``name``'s first ``rows`` rows (``name_count`` entries each)
    flat from the field's start, and fill ``name_offsets``; the entries sent of each
    (a sample's fields, and serving's batch names, travel so)."""
    counts = arrays[f"{name}_count"][:rows]
    offsets = arrays[f"{name}_offsets"]
    offsets[0] = 0
    np.cumsum(counts, out=offsets[1:rows + 1])
    padded = arrays[name]
    flat = padded.reshape(-1, *padded.shape[2:])
    for row in range(rows):  # each row moves down, never past a later one's start
        start, count = int(offsets[row]), int(counts[row])
        flat[start:start + count] = padded[row, :count]
    return {name: int(offsets[rows]), f"{name}_offsets": rows + 1}


def row_sample(arrays: dict[str, np.ndarray], row: int) -> Sample:
    """Row ``row`` of a batch being filled, as a Sample of views (written in place): the
    decoder's ``image`` uint8 [3, H, W] and whichever fields the stream has, ``mask``
    [H, W], ``boxes`` [k, 5] and ``meta`` [n] (their rows' first k / n entries).
    What a per-sample transform that runs after the decode sees."""
    sample: Sample = {"image": arrays.get("decoded", arrays["image"])[row]}
    if MASK in arrays:
        sample[MASK] = arrays[MASK][row]
    for name in _VARIABLE:
        if f"{name}_count" in arrays:
            sample[name] = arrays[name][row, :int(arrays[f"{name}_count"][row])]
    return sample


def nearest_window(source: np.ndarray, box, height: int, width: int, flip: bool = False
                   ) -> np.ndarray:
    """``box`` (top, left, h, w) of ``source`` [h, w] resized to height x width, nearest.

    As Pillow's NEAREST resize picks pixels: output pixel i takes source pixel
    floor(c_i), c_0 = start + step / 2 and c_{i+1} = c_i + step, step = box / output
    (accumulated as Pillow does, so that both pick the same pixel at exact ties).
    """
    top, left, h, w = box
    rows = _centres(top, h / height, height, source.shape[0])
    cols = _centres(left, w / width, width, source.shape[1])
    if flip:
        cols = cols[::-1]
    return source[rows[:, None], cols[None, :]]


def _centres(start: float, step: float, count: int, limit: int) -> np.ndarray:
    steps = np.full(count, step)
    steps[0] = start + step * 0.5
    return np.clip(np.floor(np.add.accumulate(steps)).astype(np.int64), 0, limit - 1)


def _is_json(sidecar: Sidecar) -> bool:
    return sidecar.suffix.lower().endswith(".json")


def _parse_boxes(data: bytes, is_json: bool, limit: int) -> np.ndarray | None:
    """[k, 5] float64 boxes from a sidecar, or None when it has more than ``limit``;
    DecodeError saying what is wrong."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"boxes: not utf-8 text: {e}") from None
    rows = _json_rows(data, text, limit) if is_json else _text_rows(text, limit)
    if rows is None:
        return None
    boxes = np.empty((len(rows), _BOX_COLUMNS), np.float64)
    for i, values in enumerate(rows):
        try:
            if not isinstance(values, list) or len(values) != _BOX_COLUMNS:
                raise ValueError
            boxes[i] = [float(v) for v in values]
        except (TypeError, ValueError):
            raise DecodeError(f"boxes: box {i} is not x0 y0 x1 y1 class: {values!r:.60}") from None
        if not all(math.isfinite(v) for v in boxes[i]):
            raise DecodeError(f"boxes: box {i} is not finite: {values!r:.60}")
        if boxes[i, 2] < boxes[i, 0] or boxes[i, 3] < boxes[i, 1]:
            raise DecodeError(f"boxes: box {i} has x1 < x0 or y1 < y0: {values!r:.60}")
    return boxes


def _text_rows(text: str, limit: int) -> list | None:
    """Each box line's words (blank lines and ``#`` comments skipped), read up to the
    ``limit + 1``-th box: None if there is one."""
    rows = []
    for line in io.StringIO(text, newline=None):  # one line at a time, \r\n and \r too
        words = line.split()
        if words and not words[0].startswith("#"):
            if len(rows) == limit:
                return None
            rows.append(words)
    return rows


def _json_rows(data: bytes, text: str, limit: int) -> list | None:
    """The JSON list of box lists; None if it has more than ``limit`` boxes.

    Counted before parsing, since the parse holds the GIL: ``k`` boxes have
    ``k + 1`` opening brackets and ``5k - 1`` commas, 6k in all, so a document
    with more than ``6 * limit`` of them (and ``_SPARE_TOKENS``, so that a
    malformed one is still parsed and said to be) has too many, and the parse
    reads at most so many values.
    """
    tokens = data.count(b"[") + data.count(b"{") + data.count(b",")
    if tokens > (_BOX_COLUMNS + 1) * limit + _SPARE_TOKENS:
        return None
    try:
        rows = jsontext.loads(text)
    except ValueError as e:
        raise DecodeError(f"boxes: not JSON: {e}") from None
    if not isinstance(rows, list):
        raise DecodeError("boxes: the JSON must be a list of [x0, y0, x1, y1, class] lists")
    return rows if len(rows) <= limit else None
