"""Common mistakes refused at ``loader(...)``, each saying what to write instead; and the
forms of the same intent that are not mistakes, accepted: list files labelled by spaces
(Caffe's and mmcls's ``path label``), numpy values in transform parameters."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest

from gpufeed.client import FeedError, Output
from gpufeed.v1 import feed_pb2, feed_pb2_grpc

UNITS = "mean and std are in units of x/255: for 0-255 values divide by 255"
IMAGENET_255 = dict(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))


@pytest.mark.parametrize("values, named, instead", [
    (IMAGENET_255, "mean", "mean=(0.485, 0.456, 0.406)"),
    ({"mean": (0.485, 0.456, 0.406), "std": (58.395, 57.12, 57.375)}, "std",
     "std=(0.229, 0.224, 0.225)"),
    ({"mean": np.array([123.675, 116.28, 103.53]), "std": np.ones(3)}, "mean",
     "mean=(0.485, 0.456, 0.406)"),
], ids=["both", "std", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mean_and_std_in_0_255_units_are_refused_at_loader(feed, image_names, values, named,
                                                           instead, dtype):
    """DALI's and mmcv's 0-255 habit, on an output scaled by 1/255 (every float dtype):
    each output would land near -2. Flat keywords and Output alike."""
    for kwargs in ({**values}, {"output": Output(size=8, dtype=dtype, **values)}):
        if "output" not in kwargs:
            kwargs.update(size=8, dtype=dtype)
        with pytest.raises(ValueError) as refused:
            feed.loader(image_names[:2], batch_size=2, **kwargs)
        message = str(refused.value)
        assert message.startswith(f"{named}=") and UNITS in message and instead in message


@pytest.mark.parametrize("field", ["mean", "std"])
def test_a_raw_request_in_0_255_units_is_refused_naming_the_field(server, image_names, field):
    output = feed_pb2.OutputSpec(height=8, width=8, dtype="float32", mean=[0.5] * 3,
                                 std=[0.25] * 3)
    getattr(output, field)[:] = IMAGENET_255[field]
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=image_names[:2]),
                                     batch_size=2, output=output,
                                     transport=feed_pb2.TRANSPORT_INLINE)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(feed_pb2_grpc.FeedStub(channel).Stream(
                iter([feed_pb2.ClientMessage(open=request)]), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"output.{field} ")
    assert UNITS in refused.value.details()


@pytest.mark.parametrize("line", ["{name}\t3", "{name} 3", "{name}  \t 3", "{name} -1"])
def test_a_labelled_list_file_without_labels_list_file_is_refused_at_loader(
        feed, data_dir, image_names, line):
    """Read as paths only, every line would name a file that is not there, and the pass
    would end with DATA_LOSS at its first batch; the first line tells. Not every line
    ending in a number is labelled: a name without a sample suffix may end so
    (``frame 12``), and a list of such names is served as paths."""
    (data_dir / "labelled-misread.flist").write_text(
        "".join(line.format(name=name) + "\n" for name in image_names[:4]))
    with pytest.raises(FeedError) as refused:
        feed.loader("labelled-misread.flist", batch_size=2, size=8)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    message = str(refused.value)
    assert message.startswith("INVALID_ARGUMENT: files (list_file): 'labelled-misread.flist' "
                              "has labels")
    assert 'pass labels="list_file"' in message

    shutil.copy(data_dir / image_names[0], data_dir / "frame 12")
    (data_dir / "frames.flist").write_text("frame 12\n")
    (batch,) = list(feed.loader("frames.flist", batch_size=1, size=8))
    assert batch["index"].tolist() == [0]


@pytest.fixture()
def spaced(data_dir, image_names):
    """Files whose names hold spaces and end in numbers, beside the data set's."""
    for name in ("my file.jpg", "my file 3.jpg", "7"):
        shutil.copy(data_dir / image_names[0], data_dir / name)


@pytest.mark.parametrize("text, expected", [
    # Caffe / mmcls: the label is the last whitespace-separated word.
    ("img0000.jpg 3\nmy file.jpg 5\nmy file 3.jpg 4\n7 9\n",
     [("img0000.jpg", 3), ("my file.jpg", 5), ("my file 3.jpg", 4), ("7", 9)]),
    # Trailing spaces, CRLF, blank lines, several spaces or a TAB between.
    ("img0000.jpg 3  \r\n\r\nmy file.jpg\t 5\r\nmy file 3.jpg    4 \r\n",
     [("img0000.jpg", 3), ("my file.jpg", 5), ("my file 3.jpg", 4)]),
    # A TAB on the first line: every line is path<TAB>label, spaces around the TAB not
    # the path's.
    ("my file.jpg\t5\nmy file 3.jpg \t 4\r\nimg0000.jpg\t-1\n",
     [("my file.jpg", 5), ("my file 3.jpg", 4), ("img0000.jpg", -1)]),
], ids=["spaces", "crlf_trailing_mixed", "tabs"])
def test_labels_from_a_list_file_separated_by_spaces_or_a_tab(feed, data_dir, spaced, text,
                                                              expected):
    (data_dir / "spaced.flist").write_bytes(text.encode())
    loader = feed.loader("spaced.flist", batch_size=8, size=8, labels="list_file")
    (batch,) = list(loader)
    assert loader.failures == []  # each path found: none took its label or lost a space
    assert batch["label"].tolist() == [label for _, label in expected]


def test_a_list_file_line_without_its_label_is_refused_naming_it(feed, data_dir, spaced):
    cases = [
        # A space file: the first line decides, and a later line without a label is named.
        ("img0000.jpg\nimg0001.jpg 2\n", ["line 1", "path, whitespace, integer label"]),
        ("img0000.jpg 2\nmy file.jpg\n", ["line 2", "path, whitespace, integer label"]),
        # In a TAB file, a line with no TAB has no label, though it ends in a number.
        ("img0000.jpg\t3\nmy file 3.jpg\n", ["line 2", "path<TAB>integer label",
                                            "my file 3.jpg"]),
        ("img0000.jpg 2.5\n", ["line 1", "img0000.jpg 2.5"]),
        ("img0000.jpg 99999999999999999999\n", ["line 1"]),
    ]
    for text, words in cases:
        (data_dir / "unlabelled.flist").write_text(text)
        with pytest.raises(FeedError) as refused:
            feed.loader("unlabelled.flist", batch_size=2, size=8, labels="list_file")
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(refused.value).startswith("INVALID_ARGUMENT: files (list_file): ")
        for word in words:
            assert word in str(refused.value), (text, str(refused.value))


def test_numpy_values_in_transform_parameters_are_sent_as_json(feed, image_names):
    """A numpy scalar or array where a number or list goes gives the batches the plain
    values give; a NaN or infinity among them is refused as a plain one is."""
    kw = dict(batch_size=4, size=16, shuffle=True, seed=3)
    plain = [("color_jitter", {"brightness": [0.6, 1.4], "hue": 0.25})]
    numpy = [("color_jitter", {"brightness": np.array([0.6, 1.4]), "hue": np.float32(0.25)})]
    expected = [b["image"].clone() for b in feed.loader(image_names[:8], transforms=plain, **kw)]
    got = [b["image"].clone() for b in feed.loader(image_names[:8], transforms=numpy, **kw)]
    assert len(got) == len(expected) == 2
    assert all((a == b).all() for a, b in zip(got, expected))
    for value in (np.float32("nan"), np.array([0.5, np.inf])):
        with pytest.raises(ValueError, match="parameters must be JSON values"):
            feed.loader(image_names[:4], batch_size=4, size=16,
                        transforms=[("color_jitter", {"brightness": value})])
