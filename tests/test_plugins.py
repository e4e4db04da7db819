"""Operator-installed sample transforms, end to end: a plugin package on the server's path,
loaded with --plugins, asked for by name from the real client."""

from __future__ import annotations

import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.media.draws import sample_rng
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc

_PLUGIN = '''
from __future__ import annotations

import numpy as np

from gpufeed.server import transforms


@transforms.register("add_constant")
def add_constant(value: int = 0):
    if not -255 <= value <= 255:
        raise ValueError(f"value must be in -255..255, got {value}")

    def apply(sample, rng):
        widened = sample["image"].astype(np.int16) + value
        sample["image"] = np.clip(widened, 0, 255).astype(np.uint8)  # a new array
        return sample

    return apply


@transforms.register("fail_sometimes")
def fail_sometimes(p: float = 0.5):
    def apply(sample, rng):
        if rng.random() < p:
            raise RuntimeError("boom")
        return sample

    return apply


@transforms.register("black_under_mask")
def black_under_mask():
    def apply(sample, rng):
        sample["image"][:, sample["mask"] > 0] = 0
        return sample

    return apply


@transforms.register("keep_anything")
def keep_anything(data: list | dict | None = None):
    def apply(sample, rng):
        return sample

    return apply


def _roll(shift: int = 5):
    def apply(sample, rng):
        image = sample["image"]  # changed in place
        image[...] = np.roll(image, int(rng.integers(-shift, shift + 1)), axis=-1)
        image[0] ^= np.uint8(rng.integers(0, 256))
        return sample

    return apply


transforms.register("random_roll")(_roll)
transforms.register("random_roll_in_processes", holds_gil=True)(_roll)
'''

SIZE = 32
N = 60
SEED = 11


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """A package ``tmpplugins`` (transforms in ``tmpplugins.transforms``) outside the repo."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "tmpplugins").mkdir()
    (root / "tmpplugins" / "__init__.py").write_text("")
    (root / "tmpplugins" / "transforms.py").write_text(textwrap.dedent(_PLUGIN))
    return root


@pytest.fixture(scope="module")
def plugin_server(data_dir, plugin_path):
    examples = Path(__file__).resolve().parent.parent / "examples"
    with ServerProcess(["--data-root", str(data_dir), "--threads", "2",
                        "--plugins", "tmpplugins.transforms,noise_transforms"],
                       env={"PYTHONPATH": f"{plugin_path}:{examples}"}) as proc:
        yield proc


@pytest.fixture()
def feed(plugin_server):
    with FeedClient(plugin_server.address) as client:
        yield client


def _images(loader) -> dict[int, np.ndarray]:
    """Sample index -> its image, over one pass."""
    out = {}
    for batch in loader:
        for index, image in zip(batch["index"].tolist(), batch["image"].numpy()):
            assert index not in out
            out[index] = image.copy()
    return out


def _loader(feed, names, transforms=(), **kw):
    args = dict(batch_size=8, size=SIZE, resize="random_resized_crop", flip=0.5, shuffle=True,
                seed=SEED, transport="inline")
    args.update(kw)
    return feed.loader(names[:N], transforms=list(transforms), **args)


def test_a_plugin_transform_runs_on_every_sample(feed, image_names):
    plain = _images(_loader(feed, image_names))
    lifted = _images(_loader(feed, image_names, [("add_constant", {"value": 40})]))
    assert sorted(lifted) == list(range(N))
    for index, image in plain.items():
        expected = np.clip(image.astype(np.int16) + 40, 0, 255).astype(np.uint8)
        np.testing.assert_array_equal(lifted[index], expected, err_msg=f"sample {index}")


def test_transforms_see_uint8_rows_before_the_batch_pass(feed, image_names):
    """With a float output the transform still sees the decoded uint8 row; x / 255 after."""
    plain = _images(_loader(feed, image_names))
    floats = _images(_loader(feed, image_names, [("add_constant", {"value": 40})],
                             dtype="float32", layout="NHWC"))
    for index, image in plain.items():
        expected = np.clip(image.astype(np.int16) + 40, 0, 255).astype(np.float32) / 255
        np.testing.assert_allclose(floats[index], expected.transpose(1, 2, 0), rtol=0,
                                   atol=1e-6, err_msg=f"sample {index}")


def test_the_example_plugin_serves(feed, image_names):
    plain = _images(_loader(feed, image_names))
    noisy = _images(_loader(feed, image_names, [("gaussian_noise", {"sigma": 20.0}),
                                                ("salt_and_pepper", {"amount": 0.05})]))
    assert sorted(noisy) == list(range(N))
    changed = [not np.array_equal(plain[i], noisy[i]) for i in plain]
    assert all(changed)
    again = _images(_loader(feed, image_names, [("gaussian_noise", {"sigma": 20.0}),
                                                ("salt_and_pepper", {"amount": 0.05})]))
    for index in noisy:
        np.testing.assert_array_equal(again[index], noisy[index])


@pytest.mark.parametrize("name", ["random_roll", "random_roll_in_processes"])
def test_random_plugin_transforms_repeat_and_resume(feed, image_names, name):
    """The same pass twice is the same pixels; a pass resumed from a mid-pass state gives
    the rest of the same pass; threads and worker processes give the same pixels."""
    transforms = [("random_roll", {"shift": 6})] if name == "random_roll" else \
        [(name, {"shift": 6})]
    first = _images(_loader(feed, image_names, transforms))
    second = _images(_loader(feed, image_names, transforms))
    assert sorted(first) == list(range(N))
    for index in first:
        np.testing.assert_array_equal(first[index], second[index])
    plain = _images(_loader(feed, image_names))
    assert sum(not np.array_equal(plain[i], first[i]) for i in first) > N // 2

    loader = _loader(feed, image_names, transforms)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    batches.close()
    resumed_loader = _loader(feed, image_names, transforms)
    resumed_loader.load_state_dict(state)
    resumed = _images(resumed_loader)
    assert len(resumed) == N - 3 * 8
    for index, image in resumed.items():
        np.testing.assert_array_equal(image, first[index], err_msg=f"sample {index}")

    if name == "random_roll_in_processes":
        threads = _images(_loader(feed, image_names, [("random_roll", {"shift": 6})]))
        for index in first:
            np.testing.assert_array_equal(first[index], threads[index])


def test_another_epoch_draws_again(feed, image_names):
    one = _images(_loader(feed, image_names, [("random_roll", {})], epoch=0, shuffle=False,
                          resize="squash", flip=0.0))
    two = _images(_loader(feed, image_names, [("random_roll", {})], epoch=1, shuffle=False,
                          resize="squash", flip=0.0))
    assert sum(not np.array_equal(one[i], two[i]) for i in one) > N // 2


def test_a_raising_transform_fails_its_sample_only(feed, image_names):
    loader = _loader(feed, image_names, [("add_constant", {"value": 1}),
                                         ("fail_sometimes", {"p": 0.2})], failure_budget=N)
    images = _images(loader)
    # The second transform's generator: (seed, epoch, index, 100 + its place).
    expected = {i for i in range(N) if sample_rng(SEED, 0, i, 101).random() < 0.2}
    assert expected and len(expected) < N
    assert {index for index, _ in loader.failures} == expected
    assert set(images) == set(range(N)) - expected
    for failure in loader.failures:
        assert "transform 'fail_sometimes' failed: RuntimeError: boom" in failure.reason
        assert failure.category == "transform"


@pytest.mark.parametrize("transforms, words", [
    ([("no_such_transform", {})], ["sample_transforms[0]", "unknown transform",
                                   "'no_such_transform'", "random_roll"]),
    ([("add_constant", {"value": 1}), ("add_constant", {"valu": 1})],
     ["sample_transforms[1]", "'add_constant'", "no parameter 'valu'"]),
    ([("add_constant", {"value": "ten"})], ["'add_constant'", "parameter 'value'",
                                            "an integer"]),
    ([("add_constant", {"value": 300})], ["'add_constant'", "value must be in -255..255"]),
    ([("color_jitter", {"hue": 0.9})], ["'color_jitter'", "hue"]),
])
def test_bad_transforms_are_refused_at_open(feed, image_names, transforms, words):
    with pytest.raises(FeedError) as refused:
        _loader(feed, image_names, transforms)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in str(refused.value)


def _levels(levels: int) -> dict:
    """Parameters nested ``levels`` deep, the object itself the first level."""
    data: list = []
    for _ in range(levels - 2):
        data = [data]
    return {"data": data}


@pytest.mark.parametrize("params, words", [
    (_levels(33), ["nested deeper than 32 levels"]),
    ({"data": [0] * 40_000}, ["parameters are", "over the 65536"]),
    ({"data": {f"k{i}": i for i in range(10_000)}}, ["over the 65536"]),
])
def test_a_plugins_parameters_are_bounded_before_it_sees_them(feed, image_names, params, words):
    """Whatever a plugin's factory takes, parameters nested deeper than 32 levels or over
    64 KiB of JSON are refused by the server first, naming the transform; at the bounds
    they reach it."""
    with pytest.raises(FeedError) as refused:
        _loader(feed, image_names, [("keep_anything", params)])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for word in ["sample_transforms[0]", "'keep_anything'", *words]:
        assert word in str(refused.value), str(refused.value)
    at_bounds = [("keep_anything", _levels(32)), ("keep_anything", {"data": [0] * 20_000})]
    assert sorted(_images(_loader(feed, image_names, at_bounds))) == list(range(N))


@pytest.mark.parametrize("params_json, words", [
    ('{"data": ' + "[" * 100_000 + "]" * 100_000 + "}", ["over the 65536"]),
    ('{"data": ' + "[" * 30_000 + "]" * 30_000 + "}", ["nested deeper than 32 levels"]),
    ('{"data": [1, Infinity]}', ["parameter 'data'", "finite"]),
    ('{"data": {"a": [NaN]}}', ["parameter 'data'", "finite"]),
    ('{"data": [1e999]}', ["parameter 'data'", "finite"]),
])
def test_a_plugins_parameters_sent_raw_are_invalid_argument(plugin_server, feed, image_names,
                                                            params_json, words):
    """What the client would not send (100,000 levels deep, NaN, Infinity) is refused as
    INVALID_ARGUMENT naming the transform, not UNKNOWN with a recursion error; the server
    serves on."""
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=image_names[:N]), batch_size=8,
        output=feed_pb2.OutputSpec(height=SIZE, width=SIZE), transport=feed_pb2.TRANSPORT_INLINE,
        prefetch=1, sample_transforms=[feed_pb2.SampleTransform(name="keep_anything",
                                                               params_json=params_json)])
    with grpc.insecure_channel(plugin_server.address) as channel:
        call = feed_pb2_grpc.FeedStub(channel).Stream(
            iter([feed_pb2.ClientMessage(open=request)]), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    for word in ["sample_transforms[0]", "'keep_anything'", *words]:
        assert word in info.value.details(), info.value.details()
    assert sorted(_images(_loader(feed, image_names, [("keep_anything", {})]))) == list(range(N))


def test_parameters_must_be_json(feed, image_names):
    with pytest.raises(ValueError, match=r"transforms\[0\] 'add_constant'.*JSON"):
        _loader(feed, image_names, [("add_constant", {"value": object()})])


def test_a_plugin_that_does_not_import_stops_the_server(data_dir, plugin_path):
    proc = ServerProcess(["--data-root", str(data_dir), "--plugins", "tmpplugins.missing"],
                         env={"PYTHONPATH": str(plugin_path)}, timeout=30)
    with pytest.raises(RuntimeError, match="did not become ready"):
        proc.start()
    assert proc.proc.wait(10) == 2
    assert "--plugins tmpplugins.missing: cannot import it" in "".join(proc.log)


def test_video_and_arrays_take_no_transforms(feed, data_dir, tmp_path):
    arrays = data_dir / "plugin_arrays"
    arrays.mkdir(exist_ok=True)
    np.save(arrays / "a.npy", np.zeros((2, 2), np.float32))
    with pytest.raises(FeedError, match="only image samples take sample transforms"):
        feed.loader(["plugin_arrays/a.npy"], batch_size=1, transforms=["random_roll"])


def test_a_state_saved_with_other_transforms_is_refused(feed, image_names):
    state = _loader(feed, image_names, [("random_roll", {"shift": 6})]).state_dict()
    other = _loader(feed, image_names, [("random_roll", {"shift": 5})])
    with pytest.raises(ValueError, match="sample_transforms differs"):
        other.load_state_dict(state)
    _loader(feed, image_names, [("random_roll", {"shift": 6})]).load_state_dict(state)


def test_a_worker_process_that_dies_fails_its_sample_and_the_pool_starts_anew(tmp_path,
                                                                              monkeypatch):
    """A GIL-holding transform whose worker process dies (a crash in a C extension, say):
    that sample fails, naming the transform; the next sample gets a fresh pool."""
    from gpufeed.server import transforms
    from gpufeed.server.media.transforms import runner as pipeline
    from gpufeed.v1 import feed_pb2

    (tmp_path / "dying_plugin.py").write_text(textwrap.dedent('''
        import os
        from gpufeed.server import transforms

        @transforms.register("die_on_odd", holds_gil=True)
        def die_on_odd():
            def apply(sample, rng):
                if sample["image"][0, 0, 0] % 2:
                    os._exit(3)
                sample["image"][...] = 7
                return sample
            return apply
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers inherit sys.path
    transforms.load(["dying_plugin"])
    steps = pipeline.SampleTransforms.from_request(
        [feed_pb2.SampleTransform(name="die_on_odd")], seed=0, epoch=0)
    arrays = {"image": np.zeros((3, 3, 4, 4), np.uint8)}
    arrays["image"][1] = 1
    try:
        steps.apply(arrays, 0, 0)
        with pytest.raises(pipeline.TransformFailed, match="transform 'die_on_odd' failed"):
            steps.apply(arrays, 1, 1)
        steps.apply(arrays, 2, 2)
    finally:
        pipeline.shutdown_processes()
    assert (arrays["image"][[0, 2]] == 7).all() and (arrays["image"][1] == 1).all()


def test_a_transform_sees_the_samples_fields(feed, data_dir, image_names):
    """With fields=["mask"], a transform gets the mask row, cropped and flipped as the image."""
    from PIL import Image

    folder = data_dir / "plugin_masks"
    folder.mkdir(exist_ok=True)
    names = []
    for i, name in enumerate(image_names[:8]):
        (folder / name).write_bytes((data_dir / name).read_bytes())
        with Image.open(data_dir / name) as im:
            width, height = im.size
        mask = np.zeros((height, width), np.uint8)
        mask[:, : width // (2 + i % 3)] = 1 + i
        Image.fromarray(mask).save(folder / name.replace(".jpg", ".png"))
        names.append(f"plugin_masks/{name}")
    kw = dict(batch_size=4, size=SIZE, resize="random_resized_crop", flip=0.5, seed=SEED,
              transport="inline", fields=["mask"])
    plain = {}
    for batch in feed.loader(names, **kw):
        for index, image, mask in zip(batch["index"].tolist(), batch["image"], batch["mask"]):
            plain[index] = (image.numpy().copy(), mask.numpy().copy())
    masked = _images(feed.loader(names, transforms=["black_under_mask"], **kw))
    assert sorted(masked) == list(range(8))
    both = 0  # samples whose crop holds masked and unmasked pixels
    for index, (image, mask) in plain.items():
        both += bool((mask > 0).any() and (mask == 0).any())
        expected = image.copy()
        expected[:, mask > 0] = 0
        np.testing.assert_array_equal(masked[index], expected, err_msg=f"sample {index}")
    assert both > 0


def test_a_transform_that_moves_the_image_alone_is_refused_beside_a_mask(feed, data_dir,
                                                                         image_names):
    """trivial_augment_wide may rotate the image but not its mask: with fields=["mask"] the
    request is refused at open, naming the transform; colour changes stay allowed."""
    from PIL import Image

    folder = data_dir / "plugin_moved"
    folder.mkdir(exist_ok=True)
    name = image_names[0]
    (folder / name).write_bytes((data_dir / name).read_bytes())
    with Image.open(data_dir / name) as im:
        Image.new("L", im.size).save(folder / name.replace(".jpg", ".png"))
    kw = dict(batch_size=1, size=SIZE, fields=["mask"])
    with pytest.raises(FeedError) as info:
        feed.loader([f"plugin_moved/{name}"], transforms=["trivial_augment_wide"], **kw)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sample_transforms[0]" in str(info.value) and "mask" in str(info.value)
    (batch,) = list(feed.loader([f"plugin_moved/{name}"], transforms=["color_jitter"], **kw))
    assert batch["mask"].shape[0] == 1
