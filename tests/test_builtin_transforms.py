"""The built-in augmentations against references written here from torchvision.transforms.v2's
documented formulas (torchvision does not import against this CPU torch), in plain torch,
numpy or Pillow, on both paths (the C kernels where they are built, and torch); the C
kernels against the torch path on odd shapes; then end to end through a real server
with fixed parameters (its default path)."""

from __future__ import annotations

import colorsys
import importlib
import math
import shutil
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from gpufeed.server.media.draws import sample_rng
from gpufeed.server.media.transforms import builtins as augment

SIZE = 48
N = 24
SEED = 5


@pytest.fixture(scope="module")
def photos() -> torch.Tensor:
    """Smooth photo-like uint8 [4, 3, 37, 53] images, plus one flat grey one."""
    from gpufeed.server.demo import synthetic_photo

    rng = np.random.default_rng(3)
    images = [synthetic_photo(rng, 37, 53).transpose(2, 0, 1) for _ in range(3)]
    images.append(np.full((3, 37, 53), 77, np.uint8))
    return torch.from_numpy(np.stack(images))


@pytest.fixture(params=["torch", "C"])
def kernels(request):
    """The kernel tests run on both paths: torch's operations, and the C kernels."""
    if request.param == "C" and not augment.NATIVE_BUILT:
        pytest.skip("the C kernels (gpufeed.server.media.transforms._augment) are not built")
    augment.use_native(request.param == "C")
    yield request.param
    augment.use_native(augment.NATIVE_BUILT)


def _gray_ref(image: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma, 0.2989 R + 0.587 G + 0.114 B, floored for uint8 images; summed in
    torchvision's order (R, + G, + B), so float32 rounds as in torchvision."""
    r, g, b = (image[..., c, :, :].to(torch.float32) for c in range(3))
    return torch.add(torch.add(r * 0.2989, g, alpha=0.587), b, alpha=0.114).floor().unsqueeze(-3)


def _blend_ref(image, other, factor):
    """factor * image + (1 - factor) * other (torchvision's order), clamped, truncated."""
    mixed = torch.add(image.to(torch.float32) * factor, other, alpha=1 - factor)
    return mixed.clamp(0, 255).to(torch.uint8)


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(largest difference, fraction of values that differ)."""
    diff = (a.to(torch.int16) - b.to(torch.int16)).abs()
    return int(diff.max()), float((diff > 0).float().mean())


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("factor", [0.0, 0.35, 1.0, 1.7])
def test_brightness_saturation_contrast(photos, factor):
    assert torch.equal(augment.adjust_brightness(photos, factor),
                       (photos.to(torch.float32) * factor).clamp(0, 255).to(torch.uint8))
    gray = _gray_ref(photos)
    mean = gray.mean(dim=(-3, -2, -1), keepdim=True)
    for ours, reference in ((augment.adjust_saturation(photos, factor),
                             _blend_ref(photos, gray, factor)),
                            (augment.adjust_contrast(photos, factor),
                             _blend_ref(photos, mean, factor))):
        assert torch.equal(ours, reference)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("hue", [-0.5, -0.2, 0.05, 0.33])
def test_hue_is_an_hsv_rotation(photos, hue):
    """Against colorsys (float64) per pixel: within 1 of 255, float32 against float64."""
    ours = augment.adjust_hue(photos, hue)
    pixels = photos.permute(0, 2, 3, 1).reshape(-1, 3).numpy() / 255
    expected = []
    for r, g, b in pixels.tolist():
        h, s, v = colorsys.rgb_to_hsv(r, g, b)
        expected.append(colorsys.hsv_to_rgb((h + hue) % 1.0, s, v))
    reference = torch.from_numpy((np.asarray(expected) * 255.999).astype(np.uint8))
    reference = reference.reshape(photos.shape[0], *photos.shape[2:], 3).permute(0, 3, 1, 2)
    largest, fraction = _mismatch(ours, reference)
    assert largest <= 1 and fraction < 0.01, (largest, fraction)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("factor", [0.0, 0.5, 1.99])
def test_sharpness(photos, factor):
    """The 3x3 kernel (1 around, 5 in the centre, / 13), rounded, blended inside a
    one-pixel border; the border kept."""
    x = photos.to(torch.float32)
    padded = x[..., :, :]
    h, w = x.shape[-2:]
    ring = sum(padded[..., 1 + dy:h - 1 + dy, 1 + dx:w - 1 + dx]
               for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx)
    smooth = ((ring + 5 * x[..., 1:-1, 1:-1]) / 13).round()
    reference = x.clone()
    inner = x[..., 1:-1, 1:-1]  # x + (1 - factor)(smooth - x): torchvision's order
    reference[..., 1:-1, 1:-1] = torch.add(inner, smooth - inner, alpha=1 - factor)
    reference = reference.clamp(0, 255).to(torch.uint8)
    assert torch.equal(augment.adjust_sharpness(photos, factor), reference)


def _pil_each(photos: torch.Tensor, op) -> torch.Tensor:
    out = [np.asarray(op(Image.fromarray(p.permute(1, 2, 0).numpy()))).transpose(2, 0, 1)
           for p in photos]
    return torch.from_numpy(np.stack(out))


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("bits", [1, 4, 7, 8])
def test_posterize_matches_pillow(photos, bits):
    assert torch.equal(augment.posterize(photos, bits),
                       _pil_each(photos, lambda im: ImageOps.posterize(im, bits)))


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("threshold", [0, 100, 128, 255])
def test_solarize_matches_pillow(photos, threshold):
    assert torch.equal(augment.solarize(photos, threshold),
                       _pil_each(photos, lambda im: ImageOps.solarize(im, threshold)))


@pytest.mark.usefixtures("kernels")
def test_equalize_matches_pillow(photos):
    assert torch.equal(augment.equalize(photos), _pil_each(photos, ImageOps.equalize))


@pytest.mark.usefixtures("kernels")
def test_autocontrast(photos):
    """Each channel stretched to [0, 255]: (x - min) / ((max - min) (1 / 255)), truncated
    (a flat channel kept); within 1 of Pillow's autocontrast, which rounds its table."""
    x = photos.to(torch.float32)
    low = x.amin(dim=(-2, -1), keepdim=True)
    high = x.amax(dim=(-2, -1), keepdim=True)
    span = torch.where(high > low, (high - low) * (1 / 255), torch.ones_like(high))
    low = torch.where(high > low, low, torch.zeros_like(low))
    reference = ((x - low) / span).clamp(0, 255).to(torch.uint8)
    ours = augment.autocontrast(photos)
    assert torch.equal(ours, reference)
    largest, _ = _mismatch(ours, _pil_each(photos, ImageOps.autocontrast))
    assert largest <= 1


def _warp_ref(image: torch.Tensor, inverse, fill=0) -> torch.Tensor:
    """Nearest-neighbour warp in float64: output pixel (x, y), as offsets from the image's
    centre, maps to inverse(x, y) in the input; rounded half to even; outside: fill."""
    _, h, w = image.shape
    ys, xs = np.meshgrid(np.arange(h) - (h - 1) / 2, np.arange(w) - (w - 1) / 2, indexing="ij")
    sx, sy = inverse(xs, ys)
    ix, iy = np.rint(sx + (w - 1) / 2).astype(int), np.rint(sy + (h - 1) / 2).astype(int)
    inside = (0 <= ix) & (ix < w) & (0 <= iy) & (iy < h)
    out = np.full(image.shape, fill, np.uint8)
    src = image.numpy()
    out[:, inside] = src[:, iy[inside], ix[inside]]
    return torch.from_numpy(out)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dx, dy", [(7, 0), (-13, 0), (0, 9), (0, -32)])
def test_translate(photos, dx, dy):
    image = photos[0]
    ours = augment.affine(image, translate=(dx, dy))
    assert torch.equal(ours, _warp_ref(image, lambda x, y: (x - dx, y - dy)))


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("angle", [30.0, -67.5, 90.0, 180.0, 270.0, 135.0])
def test_rotate(photos, angle):
    """Counter-clockwise (image y points down, so (x, y) -> (x cos + y sin, -x sin + y cos))."""
    image = photos[0]
    a = math.radians(angle)
    reference = _warp_ref(image, lambda x, y: (x * math.cos(a) - y * math.sin(a),
                                               x * math.sin(a) + y * math.cos(a)))
    largest, fraction = _mismatch(augment.rotate(image, angle), reference)
    # float32 grid against float64: a sample point on a pixel edge may round either way
    # (30 degrees: 0.5% of the pixels).
    assert fraction < 0.01, fraction
    square = photos[0][:, :37, :37]
    if angle % 90 == 0:
        assert torch.equal(augment.rotate(square, angle),
                           torch.rot90(square, int(angle // 90), (-2, -1)))


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("magnitude", [0.3, -0.99])
@pytest.mark.parametrize("axis", ["ShearX", "ShearY"])
def test_shear_about_the_top_left_corner(photos, axis, magnitude):
    """TrivialAugmentWide's shears, about the top-left corner: the output at (x, y) is the
    input at (x + m y, y) (ShearX) or (x, y + m x) (ShearY), as AutoAugment's Pillow
    transforms (1, m, 0, 0, 1, 0) and (1, 0, 0, m, 1, 0)."""
    image = photos[0]
    _, h, w = image.shape
    cx, cy = -(w - 1) / 2 - 0.5, -(h - 1) / 2 - 0.5  # pixel (0, 0)'s corner, from the centre
    if axis == "ShearX":
        inverse = lambda x, y: (x + magnitude * (y - cy), y)  # noqa: E731
    else:
        inverse = lambda x, y: (x, y + magnitude * (x - cx))  # noqa: E731
    assert torch.equal(augment.apply_wide_op(image, axis, magnitude), _warp_ref(image, inverse))


@pytest.mark.usefixtures("kernels")
def test_fill_marks_what_comes_from_outside(photos):
    out = augment.affine(photos[0], translate=(10, 0), fill=[1.0, 2.0, 3.0])
    assert out[:, :, :10].tolist() == [[[1] * 10] * 37, [[2] * 10] * 37, [[3] * 10] * 37]
    assert torch.equal(out[:, :, 10:], photos[0][:, :, :-10])


# --- the C kernels against the torch path ------------------------------------------------------

needs_c = pytest.mark.skipif(not augment.NATIVE_BUILT,
                             reason="the C kernels (media/transforms/_augment.c) are not built")

# Odd shapes: single pixels, rows and columns, sizes no vector width divides, a batch.
_SHAPES = [(3, 1, 1), (3, 2, 5), (3, 3, 3), (3, 7, 13), (3, 37, 53), (2, 3, 17, 9)]


def _both(fn, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(image) on the C kernels, then on the torch path."""
    try:
        c = fn(image)
        augment.use_native(False)
        return c, fn(image)
    finally:
        augment.use_native(True)


def _noise(shape, seed=0) -> torch.Tensor:
    """Uniform noise (every hue sector), with a black and a white pixel where there is
    room."""
    image = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, shape, np.uint8))
    image[..., 0, 0] = 0
    image[..., -1, -1] = 255 if image.shape[-1] * image.shape[-2] > 1 else 0
    return image


@pytest.fixture(params=["wide", "baseline"])
def variant(request):
    """The C kernels are compiled twice, for AVX2 + FMA and for any x86-64: both run."""
    native = importlib.import_module("gpufeed.server.media.transforms._augment")
    if native.use_wide(request.param == "wide") != (request.param == "wide"):
        pytest.skip("no AVX2 + FMA variant on this CPU or compiler")
    yield request.param
    native.use_wide(True)


@needs_c
@pytest.mark.usefixtures("variant")
@pytest.mark.parametrize("shape", _SHAPES)
def test_c_colour_kernels_equal_the_torch_path(shape):
    """The same float32 operations in the same order (fused where torch's vectorised add
    fuses): equal, pixel for pixel, for factors inside and outside [0, 1]."""
    image = _noise(shape)
    for factor in (0.0, 0.37, 1.0, 1.41, 2.99):
        for kernel in (augment.adjust_brightness, augment.adjust_saturation,
                       augment.adjust_contrast, augment.adjust_sharpness):
            c, reference = _both(lambda x, k=kernel, f=factor: k(x, f), image)
            assert torch.equal(c, reference), (kernel.__name__, factor)
    for hue in (-0.5, -0.31, -0.01, 0.0, 0.1, 0.5):
        c, reference = _both(lambda x, h=hue: augment.adjust_hue(x, h), image)
        assert torch.equal(c, reference), hue
    for kernel in (augment.autocontrast, augment.equalize):
        c, reference = _both(kernel, image)
        assert torch.equal(c, reference), kernel.__name__


@needs_c
def test_c_kernels_on_photos_grey_images_and_views(photos):
    """Smooth photos, a flat grey image (equalize and autocontrast keep it), a
    non-contiguous view (a flip and a crop), and no input changed."""
    before = photos.clone()
    views = [photos, photos.flip(-1), photos[:, :, 3:30, 5:40]]
    for image in views:
        for name, fn in [("brightness", lambda x: augment.adjust_brightness(x, 1.3)),
                         ("saturation", lambda x: augment.adjust_saturation(x, 0.6)),
                         ("contrast", lambda x: augment.adjust_contrast(x, 1.6)),
                         ("hue", lambda x: augment.adjust_hue(x, 0.21)),
                         ("sharpness", lambda x: augment.adjust_sharpness(x, 1.9)),
                         ("autocontrast", augment.autocontrast),
                         ("equalize", augment.equalize)]:
            c, reference = _both(fn, image)
            assert torch.equal(c, reference), name
    assert torch.equal(photos, before)


@needs_c
@pytest.mark.parametrize("shape", [(1, 7, 13), (1, 37, 53), (2, 1, 9, 4)])
def test_c_kernels_take_one_channel_images(shape):
    """The per-plane kernels take any number of channels; the RGB ones (saturation,
    contrast, hue) leave 1-channel images to the torch path."""
    image = _noise(shape, seed=1)
    for fn in (lambda x: augment.adjust_brightness(x, 1.7),
               lambda x: augment.adjust_sharpness(x, 0.2), augment.autocontrast,
               augment.equalize,
               lambda x: augment.apply_wide_op(x, "TranslateX", -3.0, fill=[9.0])):
        c, reference = _both(fn, image)
        assert torch.equal(c, reference)


@needs_c
@pytest.mark.usefixtures("variant")
@pytest.mark.parametrize("shape", [*_SHAPES, (3, 64, 64)])
def test_c_warp_agrees_with_the_torch_path(shape):
    """The C warp maps pixels in double (the formula: test_translate, test_rotate and
    test_shear hold it to a float64 reference), torch's grid_sample path in float32. They
    differ only at ties, where the exact source point lies on a pixel's edge (at 30
    degrees sin is 1/2, so half-pixel offsets are common) and either neighbour is right:
    measured at most 3 pixels of the 7x13 image and 0.8% of a 64x64 one (-45 degrees),
    0.4% of a 224x224 one over TrivialAugmentWide's magnitudes; hence 1% plus 3
    pixels. Translations move whole pixels: equal."""
    image = _noise(shape, seed=2)
    pixels = shape[-1] * shape[-2]
    for op, magnitude in [("TranslateX", 5.0), ("TranslateY", -12.0), ("ShearX", 0.31),
                          ("ShearY", -0.87), ("Rotate", 30.0), ("Rotate", -45.0),
                          ("Rotate", -121.5)]:
        for fill in (None, [7.0, 120.4, 255.0]):
            c, reference = _both(lambda x, op=op, m=magnitude, fill=fill:
                                 augment.apply_wide_op(x, op, m, fill), image)
            moved = int((c != reference).any(-3).sum()) / (c.numel() // shape[-3] // pixels)
            if op.startswith("Translate"):
                assert moved == 0, (op, fill)
            else:
                assert moved <= 0.01 * pixels + 3, (op, magnitude, fill, moved)


@needs_c
def test_c_kernels_release_the_gil():
    """While a C kernel runs, another Python thread runs. With a switch interval too long
    to ever force a switch, a thread that calls a kernel in a loop hands the GIL over
    only where a kernel releases it: the main thread then gets in and stops the loop
    after a few calls. A kernel holding the GIL would run all its calls first."""
    native = importlib.import_module("gpufeed.server.media.transforms._augment")
    side, calls_at_most = 128, 20000
    image = _noise((3, side, side), seed=3).numpy()
    out = np.empty_like(image)
    plane = side * side
    kernels = {
        "brightness": lambda: native.brightness(image, out, 1, 3, plane, 1.2),
        "saturation": lambda: native.saturation(image, out, 1, 3, plane, 0.5),
        "contrast": lambda: native.contrast(image, out, 1, 3, plane, 0.5),
        "hue": lambda: native.hue(image, out, 1, 3, plane, 0.2),
        "sharpness": lambda: native.sharpness(image, out, 3, side, side, 1.5),
        "autocontrast": lambda: native.autocontrast(image, out, 3, 1, plane),
        "equalize": lambda: native.equalize(image, out, 3, 1, plane),
        "warp": lambda: native.warp(image, out, 1, 3, side, side, (0.8, 0.6, 3, -0.6, 0.8, 1),
                                    None),
    }
    for name, kernel in kernels.items():
        stop, calls = [], []

        def loop(kernel=kernel, stop=stop, calls=calls):
            while not stop and len(calls) < calls_at_most:
                kernel()
                calls.append(1)

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1000.0)
        try:
            thread = threading.Thread(target=loop)
            thread.start()
            stop.append(True)  # needs the GIL: runs while a kernel has it released
            thread.join()
        finally:
            sys.setswitchinterval(interval)
        assert len(calls) < calls_at_most, name


def test_the_c_kernels_are_built_where_there_is_a_compiler():
    """The extension is optional at build time; where a C compiler is present a build
    that silently fell back to the torch path would only show as slowness."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert augment.NATIVE_BUILT


# --- parameter ranges as torchvision's -----------------------------------------------------------

@pytest.mark.parametrize("params, message", [
    ({"brightness": -0.1}, "brightness must be non-negative"),
    ({"contrast": [1.5, 0.5]}, "contrast values must satisfy"),
    ({"saturation": [1, 2, 3]}, "saturation must be a number or [min, max]"),
    ({"hue": 0.6}, "hue values must satisfy -0.5 <= min <= max <= 0.5"),
    ({"hue": [-0.6, 0.1]}, "hue values must satisfy"),
])
def test_color_jitter_ranges(params, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        augment.color_jitter(**params)


def test_color_jitter_ranges_are_torchvisions():
    """A number b is [max(0, 1 - b), 1 + b] for factors and [-h, h] for hue; (1, 1) and
    0 are no adjustment at all."""
    factors = (0.0, math.inf)
    assert augment._factor_range("brightness", 1.5, 1.0, factors) == (0.0, 2.5)
    assert augment._factor_range("contrast", 0.4, 1.0, factors) == (0.6, 1.4)
    assert augment._factor_range("saturation", [1, 1], 1.0, factors) is None
    assert augment._factor_range("hue", 0.2, 0.0, (-0.5, 0.5)) == (-0.2, 0.2)
    assert augment._factor_range("hue", 0, 0.0, (-0.5, 0.5)) is None


# --- end to end: the transforms as a request names them --------------------------------------


def _images(loader) -> dict[int, torch.Tensor]:
    out = {}
    for batch in loader:
        for index, image in zip(batch["index"].tolist(), batch["image"]):
            out[index] = image.clone()
    return out


def _loader(feed, names, transforms=()):
    return feed.loader(names[:N], batch_size=8, size=SIZE, resize="random_resized_crop",
                       flip=0.5, shuffle=True, seed=SEED, transport="inline",
                       transforms=list(transforms))


@pytest.mark.parametrize("params, reference", [
    ({"brightness": [1.4, 1.4]}, lambda x: augment.adjust_brightness(x, 1.4)),
    ({"contrast": [0.6, 0.6]}, lambda x: _blend_ref(x, _gray_ref(x).mean(), 0.6)),
    ({"saturation": [1.8, 1.8]}, lambda x: _blend_ref(x, _gray_ref(x), 1.8)),
])
def test_color_jitter_with_fixed_factors_end_to_end(feed, image_names, params, reference):
    plain = _images(_loader(feed, image_names))
    jittered = _images(_loader(feed, image_names, [("color_jitter", params)]))
    assert sorted(jittered) == list(range(N))
    for index, image in plain.items():
        largest, fraction = _mismatch(jittered[index], reference(image))
        assert largest <= 1 and fraction < 1e-3, (index, largest, fraction)


def _erasing_box_ref(rng, h, w, scale=(0.02, 0.33), ratio=(0.3, 3.3)):
    """RandomErasing.get_params: area in scale, log-uniform h/w in ratio, ten tries."""
    for _ in range(10):
        area = h * w * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        eh, ew = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if eh < h and ew < w:
            return int(rng.integers(0, h - eh + 1)), int(rng.integers(0, w - ew + 1)), eh, ew
    return None


def test_random_erasing_end_to_end(feed, image_names):
    plain = _images(_loader(feed, image_names))
    erased = _images(_loader(feed, image_names,
                             [("random_erasing", {"p": 0.7, "value": [10, 20, 30]})]))
    boxes = 0
    for index, image in plain.items():
        rng = sample_rng(SEED, 0, index, 100)
        expected = image.clone()
        if rng.random() < 0.7:
            box = _erasing_box_ref(rng, SIZE, SIZE)
            if box is not None:
                top, left, h, w = box
                expected[:, top:top + h, left:left + w] = torch.tensor([10, 20, 30]).view(3, 1, 1)
                boxes += 1
        assert torch.equal(erased[index], expected), index
    assert 0 < boxes < N


# TrivialAugmentWide's space as torchvision.transforms.v2 lists it: (op, magnitudes, signed).
_BINS = 31
_SPACE = [
    ("Identity", None, False),
    ("ShearX", torch.linspace(0.0, 0.99, _BINS), True),
    ("ShearY", torch.linspace(0.0, 0.99, _BINS), True),
    ("TranslateX", torch.linspace(0.0, 32.0, _BINS), True),
    ("TranslateY", torch.linspace(0.0, 32.0, _BINS), True),
    ("Rotate", torch.linspace(0.0, 135.0, _BINS), True),
    ("Brightness", torch.linspace(0.0, 0.99, _BINS), True),
    ("Color", torch.linspace(0.0, 0.99, _BINS), True),
    ("Contrast", torch.linspace(0.0, 0.99, _BINS), True),
    ("Sharpness", torch.linspace(0.0, 0.99, _BINS), True),
    ("Posterize", (8 - (torch.arange(_BINS) / ((_BINS - 1) / 6))).round().int(), False),
    ("Solarize", torch.linspace(1.0, 0.0, _BINS), False),
    ("AutoContrast", None, False),
    ("Equalize", None, False),
]


def _wide_ref(image: torch.Tensor, op: str, m: float) -> torch.Tensor | None:
    """The reference of the pixel operations (None: a geometric one, checked above)."""
    pil = lambda fn: _pil_each(image[None], fn)[0]  # noqa: E731
    return {
        "Identity": lambda: image,
        "Brightness": lambda: (image.to(torch.float32) * (1 + m)).clamp(0, 255).to(torch.uint8),
        "Color": lambda: _blend_ref(image, _gray_ref(image), 1 + m),
        "Contrast": lambda: _blend_ref(image, _gray_ref(image).mean(), 1 + m),
        "Posterize": lambda: pil(lambda im: ImageOps.posterize(im, int(m))),
        # torch compares uint8 with a float threshold in float32, as torchvision does:
        # 68 >= 255 * 0.26666668 there, not in Pillow's float64 table.
        "Solarize": lambda: torch.where(image >= 255.0 * m, 255 - image, image),
        "Equalize": lambda: pil(ImageOps.equalize),
    }.get(op, lambda: None)()


def test_trivial_augment_wide_end_to_end(feed, image_names):
    """Each sample gets one op drawn uniformly from the 14, a magnitude from 31 bins, and
    a sign by a fair coin, from its generator; the pixel ops against the references."""
    plain = _images(_loader(feed, image_names))
    augmented = _images(_loader(feed, image_names, ["trivial_augment_wide"]))
    checked = 0
    for index, image in plain.items():
        rng = sample_rng(SEED, 0, index, 100)
        op, magnitudes, signed = _SPACE[int(rng.integers(len(_SPACE)))]
        m = 0.0
        if magnitudes is not None:
            m = float(magnitudes[int(rng.integers(_BINS))])
            if signed and rng.random() <= 0.5:
                m = -m
        reference = _wide_ref(image, op, m)
        if reference is None:
            reference = augment.apply_wide_op(image, op, m)  # geometry: checked above
        else:
            checked += 1
        largest, fraction = _mismatch(augmented[index], reference)
        assert largest <= 1 and fraction < 1e-3, (index, op, m, largest, fraction)
    assert checked > 0
