"""Decodes at an image's own size, pixel for pixel against Pillow (video: PyAV's rgb24).

At its own size an image is not scaled: swscale converts it with converters of
its own, one of which left the last ``width % 16`` columns of 4:2:0 and 4:2:2
YUV unwritten, and another of which spread 4:2:0 chroma over odd heights
(src/gpufeed/server/media/decode.py says how). So every format the server takes is decoded
here over a zoo of sizes (widths 1 to 40, every residue mod 16; heights odd and
even; 1x1 to 17x33 and past them) through ``ImageDecoder.decode_into``, the call
``ImageRows.read_into`` makes, on both JPEG paths (the C extension, and PyAV as
on a server without it, which also crops through swscale), three ways:

- squashed to its own size;
- cropped to a box that is the whole image, flipped;
- centre-cropped (shorter side kept) to a square window of the output's size.

Video frames at their own size are checked the same way against PyAV's rgb24
decode, and scaled outputs (swscale's general scaler) at every output width mod
16 against Pillow's decode and bilinear resize.

Unwritten pixels cannot pass by luck: the row is filled with ``POISON`` before
each decode, and so is the freed memory the converter's frame is likely to be
handed next (``_poison_heap``); every reference is checked to be farther from
``POISON``, 0 and 255 than the tolerance (``_assert_garbage_shows``); each case
is decoded twice, and the two must agree bit for bit; and the check is per
column, so a single bad column fails whatever the mean. A real server does the
same end to end, glibc filling the memory it allocates and frees
(``MALLOC_PERTURB_``).
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable

import av
import numpy as np
import pytest
from PIL import Image

from gpufeed.client import FeedClient
from gpufeed.server.media import jpeg
from gpufeed.server.media.decode import ImageDecoder
from gpufeed.server.media.output import OutputTransform
from gpufeed.server.media.video import VideoDecoder
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2
from support import MIN_PSNR_DB, psnr

POISON = 0xAB
_GARBAGE = (0, 1, POISON, 254, 255)
# The zoo: every width from 1 to 40 at odd heights and even ones (4:2:0 chroma and the
# converter's choice both depend on the height's parity).
WIDTHS = range(1, 41)
HEIGHTS = (1, 2, 3, 8, 17, 33)
# A picture's values stay in [LOW, HIGH], its decodes within ~15 levels of that: far
# from POISON (171) and from the other values leftover memory has here (_GARBAGE).
LOW, HIGH = 40, 130

# How far a decode may be from Pillow's decode of the same file, per pixel (the max
# over each column is checked), and on average over an image of 64 pixels or more:
# - lossless formats: not at all.
# - JPEG through the C extension: libjpeg-turbo as in Pillow, and a resize at 1:1 is
#   the identity, so it is exact, a crop too (its window is decoded with a column to
#   spare on each side, so chroma upsampling sees the neighbours it has in the image).
# - JPEG through PyAV and lossy WebP: FFmpeg's decoders are not libjpeg's and
#   libwebp's. Their IDCTs round apart (1-3 levels), and the converter takes each
#   pixel's chroma from its nearest 4:2:0 sample where libjpeg and libwebp interpolate
#   ("fancy upsampling"): up to 12 levels measured on these pictures, whose colour
#   changes slowly (the gap grows with colour edges: ~60 on sharp ones, which is why
#   the pictures have none), ~1.5 on average. 16 leaves margin and is still short
#   of every garbage value (``_assert_garbage_shows`` checks each reference).
EXACT, EXTENSION_JPEG, LOSSY = (0, 0.0), (0, 0.0), (16, 3.0)
# Video against PyAV's rgb24 decode of the same file: see its test.
VIDEO = (2, 0.5)


def _picture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A uint8 [H, W, 3] picture whose colour changes slowly (sine waves) under grain and
    grey discs with sharp edges: detail in brightness, where decoders agree."""
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    fy, fx, py, px = rng.uniform(0.3, 1.0, (4, 3)) * [[1], [1], [6.3], [6.3]]
    colour = 85 + 15 * np.sin(2 * np.pi * fy * y + py) * np.cos(2 * np.pi * fx * x + px)
    grey = rng.normal(0, 4, (height, width, 1))
    rows, cols = np.mgrid[0:height, 0:width]
    for _ in range(3):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        radius = rng.uniform(1, max(2.0, min(height, width) / 3))
        grey[(rows - cy) ** 2 + (cols - cx) ** 2 < radius ** 2] += rng.choice([-20.0, 20.0])
    return np.clip(colour + grey, LOW, HIGH).astype(np.uint8)


def _saved(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _rgba(rgb: np.ndarray, rng: np.random.Generator) -> Image.Image:
    alpha = rng.integers(128, 256, rgb.shape[:2], dtype=np.uint8)
    return Image.fromarray(np.dstack([rgb, alpha]))


def _palette(rgb: np.ndarray) -> Image.Image:
    """Its own colours (Pillow's default palette would leave [LOW, HIGH])."""
    return Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE)


# name -> (encode a picture, tolerance on the C path, on the PyAV path). RGBA files keep
# their colour (the decoder drops alpha, as Pillow's convert("RGB") does).
FORMATS: dict[str, tuple[Callable[[np.ndarray, np.random.Generator], bytes],
                         tuple[int, float], tuple[int, float]]] = {
    "png": (lambda a, r: _saved(Image.fromarray(a), "PNG"), EXACT, EXACT),
    "png-rgba": (lambda a, r: _saved(_rgba(a, r), "PNG"), EXACT, EXACT),
    "png-gray": (lambda a, r: _saved(Image.fromarray(a).convert("L"), "PNG"), EXACT, EXACT),
    "png-palette": (lambda a, r: _saved(_palette(a), "PNG"), EXACT, EXACT),
    "gif": (lambda a, r: _saved(_palette(a), "GIF"), EXACT, EXACT),
    "bmp": (lambda a, r: _saved(Image.fromarray(a), "BMP"), EXACT, EXACT),
    "tiff": (lambda a, r: _saved(Image.fromarray(a), "TIFF", compression="tiff_lzw"),
             EXACT, EXACT),
    "webp-lossless": (lambda a, r: _saved(Image.fromarray(a), "WEBP", lossless=True),
                      EXACT, EXACT),
    "webp": (lambda a, r: _saved(Image.fromarray(a), "WEBP", quality=90), LOSSY, LOSSY),
    "webp-alpha": (lambda a, r: _saved(_rgba(a, r), "WEBP", quality=90), LOSSY, LOSSY),
    "jpeg-420": (lambda a, r: _saved(Image.fromarray(a), "JPEG", quality=90, subsampling=2),
                 EXTENSION_JPEG, LOSSY),
    "jpeg-422": (lambda a, r: _saved(Image.fromarray(a), "JPEG", quality=90, subsampling=1),
                 EXTENSION_JPEG, LOSSY),
    "jpeg-444": (lambda a, r: _saved(Image.fromarray(a), "JPEG", quality=90, subsampling=0),
                 EXTENSION_JPEG, LOSSY),
    "jpeg-gray": (lambda a, r: _saved(Image.fromarray(a).convert("L"), "JPEG", quality=90),
                  EXTENSION_JPEG, LOSSY),
}


def _pillow(data: bytes) -> np.ndarray:
    """Pillow's decode of ``data`` as RGB, uint8 [3, H, W]."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB")).transpose(2, 0, 1)


@pytest.fixture(params=["extension", "pyav"])
def jpeg_path(request, monkeypatch) -> str:
    """Both decode paths: as built, and as on a server without the C extension (JPEGs
    through PyAV, crops through swscale), the switches decode.py reads at each call."""
    if request.param == "extension":
        if not jpeg.AVAILABLE:
            pytest.skip("the JPEG fast path's extension is not built")
    else:
        monkeypatch.setattr(jpeg, "AVAILABLE", False)
        monkeypatch.setattr(jpeg, "takes", lambda data: False)
    return request.param


def _poison_heap(height: int, width: int) -> None:
    """Free planar RGB frames of this size filled with POISON: malloc hands out a freed
    block of the size asked for first, so a converter's output frame is likely to start
    out as POISON rather than as whatever an earlier image left there."""
    frames = [av.VideoFrame(width, height, "gbrp") for _ in range(3)]
    for frame in frames:
        for plane in frame.planes:
            np.frombuffer(plane, np.uint8)[:] = POISON
    del frames


def _decode_twice(decoder: ImageDecoder, data: bytes, shape: tuple[int, int, int],
                  crop=None, flip: bool = False) -> np.ndarray:
    """Decode into a poisoned row, twice; the two must be the same."""
    rows = []
    for _ in range(2):
        _poison_heap(*shape[1:])
        row = np.full(shape, POISON, np.uint8)
        decoder.decode_into(data, row, crop, flip)
        rows.append(row)
    np.testing.assert_array_equal(rows[0], rows[1], "two decodes of one file differ")
    return rows[0]


def _assert_garbage_shows(want: np.ndarray, tolerance: tuple[int, float]) -> None:
    """No pixel of the reference is within the tolerance of a value leftover memory has
    here (POISON, zero, the values MALLOC_PERTURB_=1 writes)."""
    gap = min(int(np.abs(want.astype(np.int16) - value).min()) for value in _GARBAGE)
    assert gap > tolerance[0], f"a reference pixel is {gap} from a garbage value"


def _assert_close(got: np.ndarray, want: np.ndarray, tolerance: tuple[int, float],
                  what: str) -> None:
    """Per column: every column's largest difference within the tolerance (one column
    of leftover memory fails, however small a part of the image), and the mean."""
    most, mean = tolerance
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    by_column = diff.max(axis=(0, 1))
    bad = np.flatnonzero(by_column > most)
    assert bad.size == 0, (f"{what}: columns {bad.tolist()} of {got.shape[2]} off by up to "
                           f"{by_column[bad].tolist()} (tolerance {most})")
    if diff[0].size >= 64:
        assert diff.mean() <= mean, f"{what}: mean difference {diff.mean():.2f} > {mean}"


def _whole(src_h: int, src_w: int) -> tuple[float, float, float, float]:
    return 0.0, 0.0, float(src_h), float(src_w)


@pytest.mark.parametrize("name", FORMATS)
def test_every_size_decodes_to_pillows_pixels(name, jpeg_path):
    """Each format over the zoo, squashed, whole-box cropped (flipped) and centre-cropped,
    at 1:1, against Pillow's decode of the same file."""
    encode, on_extension, on_pyav = FORMATS[name]
    tolerance = on_extension if jpeg_path == "extension" else on_pyav
    decoder = ImageDecoder()
    rng = np.random.default_rng([7, len(name), sum(map(ord, name))])
    for height in HEIGHTS:
        for width in WIDTHS:
            data = encode(_picture(rng, height, width), rng)
            want = _pillow(data)
            assert want.shape == (3, height, width)
            _assert_garbage_shows(want, tolerance)
            what = f"{name} {width}x{height}"
            got = _decode_twice(decoder, data, (3, height, width))
            _assert_close(got, want, tolerance, f"{what} squashed")
            got = _decode_twice(decoder, data, (3, height, width), _whole, flip=True)
            _assert_close(got, want[:, :, ::-1], tolerance, f"{what} whole box, flipped")
            side = min(height, width)
            transform = OutputTransform(feed_pb2.OutputSpec(
                height=side, width=side, resize=feed_pb2.RESIZE_SHORTER_CENTER_CROP,
                shorter_side=side), seed=0, epoch=0)
            crop, _ = transform.choose(0)
            top, left, box_h, box_w = transform.box(0, height, width)
            assert (box_h, box_w) == (side, side) and top == int(top) and left == int(left)
            got = _decode_twice(decoder, data, (3, side, side), crop)
            _assert_close(got, want[:, int(top):int(top) + side, int(left):int(left) + side],
                          tolerance, f"{what} centre crop")


@pytest.mark.parametrize("name", ["png", "gif", "webp", "webp-alpha", "jpeg-420", "jpeg-422"])
def test_scaled_squashes_stay_right_at_every_width(name, jpeg_path):
    """Scaled planar output (swscale's general scaler) at output widths of every residue
    mod 16, odd and even heights: per column within the lossy tolerance and above the
    suite's PSNR bar against Pillow's decode + bilinear resize, as other tests compare."""
    encode = FORMATS[name][0]
    decoder = ImageDecoder()
    rng = np.random.default_rng([8, len(name)])
    for src_h, src_w in ((75, 100), (74, 99), (33, 17)):
        data = encode(_picture(rng, src_h, src_w), rng)
        with Image.open(io.BytesIO(data)) as image:
            source = image.convert("RGB")
        for height in (1, 2, 29, 30):
            for width in (*WIDTHS, 113):
                if (height, width) == (src_h, src_w):
                    continue
                want = np.asarray(source.resize((width, height), Image.Resampling.BILINEAR))
                want = want.transpose(2, 0, 1)
                got = _decode_twice(decoder, data, (3, height, width))
                what = f"{name} {src_w}x{src_h} to {width}x{height}"
                _assert_close(got, want, LOSSY, what)
                assert psnr(got, want) >= MIN_PSNR_DB, what


def _video(frames: list[np.ndarray], codec: str, fmt: str) -> bytes:
    """``frames`` at 25 fps in ``codec`` (4:2:0) and container ``fmt``, a keyframe every 5."""
    height, width, _ = frames[0].shape
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 5
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


@pytest.mark.parametrize("codec,fmt", [("libx264", "mp4"), ("mpeg4", "matroska")])
def test_video_frames_at_their_own_size_are_pyavs_rgb24(codec, fmt):
    """A clip decoded at the video's own size, sizes with every kind of width (4:2:0
    video has even sides), is PyAV's rgb24 decode of the same frames: the same
    converter, packed instead of planar, so the same integers; 2 levels for a build
    whose two outputs round apart."""
    rng = np.random.default_rng(11)
    for height, width in ((48, 40), (34, 18), (90, 120), (16, 24), (30, 22), (20, 58),
                          (48, 64), (2, 2), (8, 34)):
        data = _video([_picture(rng, height, width) for _ in range(12)], codec, fmt)
        with av.open(io.BytesIO(data)) as container:
            want = np.stack([frame.to_ndarray(format="rgb24").transpose(2, 0, 1)
                             for frame in container.decode(video=0)])
        _assert_garbage_shows(want, VIDEO)
        clips = []
        for _ in range(2):
            _poison_heap(height, width)
            clip = np.full((4, 3, height, width), POISON, np.uint8)
            VideoDecoder().decode_clip_into(io.BytesIO(data), clip, stride=2,
                                            start=lambda n: 3)
            clips.append(clip)
        np.testing.assert_array_equal(clips[0], clips[1], "two decodes of one clip differ")
        for k, frame in enumerate(clips[0]):
            _assert_close(frame, want[3 + 2 * k], VIDEO, f"{codec} {width}x{height} "
                                                         f"frame {3 + 2 * k}")


# End to end: one size whose width leaves 8 columns past its last 16 (the worst case
# before) and an even height, so that swscale picks the converter.
E2E_SIZE = (34, 40)
E2E_FORMATS = {"png": "png", "gif": "gif", "bmp": "bmp", "tiff": "tif", "webp": "webp",
               "webp-lossless": "webp", "jpeg-420": "jpg"}


@pytest.fixture(scope="module")
def e2e_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    rng = np.random.default_rng(13)
    for name, suffix in E2E_FORMATS.items():
        (root / f"{name}.{suffix}").write_bytes(FORMATS[name][0](_picture(rng, *E2E_SIZE), rng))
    return root


@pytest.mark.parametrize("extension", [True, False], ids=["extension", "no-extension"])
def test_a_server_serves_native_sizes_right(e2e_root, tmp_path, extension):
    """Through a real server, squashed to the images' size and centre-cropped to a window
    of the output's size, with and without the C extension (hidden as in
    test_crops.py), glibc filling what it allocates and frees with values no picture
    has (MALLOC_PERTURB_=1: 254 and 1)."""
    env = {"MALLOC_PERTURB_": "1"}
    if not extension:
        (tmp_path / "sitecustomize.py").write_text(
            "import sys\n"
            "class _Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'gpufeed.server.media._jpeg':\n"
            "            raise ImportError('hidden by the test')\n"
            "sys.meta_path.insert(0, _Hide())\n")
        env["PYTHONPATH"] = f"{tmp_path}:{':'.join(sys.path)}"
    files = sorted(p.name for p in e2e_root.iterdir())
    height, width = E2E_SIZE
    with ServerProcess(["--data-root", str(e2e_root)], env=env) as server, \
            FeedClient(server.address) as feed:
        assert ("JPEG decoder: PyAV" in "".join(server.log)) != extension
        squashed = next(iter(feed.loader(files=files, batch_size=len(files),
                                         size=E2E_SIZE)))["image"].numpy().copy()
        cropped = next(iter(feed.loader(files=files, batch_size=len(files),
                                        size=(height, height), resize="center_crop",
                                        shorter_side=height)))["image"].numpy().copy()
    left = round((width - height) / 2)
    for row, file in enumerate(files):
        name = file.rsplit(".", 1)[0]
        _, on_extension, on_pyav = FORMATS[name]
        tolerance = on_extension if extension else on_pyav
        want = _pillow((e2e_root / file).read_bytes())
        _assert_garbage_shows(want, tolerance)
        _assert_close(squashed[row], want, tolerance, f"{file} squashed")
        _assert_close(cropped[row], want[:, :, left:left + height], tolerance,
                      f"{file} centre crop")
