"""``Output`` (src/gpufeed/client/output.py): the grouped spelling of loader()'s output options
gives the same batches as the flat keywords, and mixing them up is a clear error."""

from __future__ import annotations

import pytest
import torch

from gpufeed.client import Output


def test_output_and_flat_keywords_give_the_same_batches(feed, image_names):
    fields = dict(size=(16, 24), resize="random_resized_crop", flip=0.5, dtype="float32",
                  mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25], layout="NHWC")
    common = dict(batch_size=4, shuffle=True, seed=2, transport="inline")
    flat = list(feed.loader(image_names[:12], **common, **fields))
    grouped = list(feed.loader(image_names[:12], **common, output=Output(**fields)))
    assert len(flat) == len(grouped) == 3
    for a, b in zip(flat, grouped):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert grouped[0]["image"].shape == (4, 16, 24, 3)  # the output was applied


def test_output_with_flat_output_keywords_is_refused_naming_them(feed, image_names):
    with pytest.raises(ValueError, match="not both") as info:
        feed.loader(image_names[:4], batch_size=4, output=Output(size=8), flip=0.5)
    assert "flip" in str(info.value)


def test_a_misspelt_keyword_is_a_type_error_naming_it(feed, image_names):
    with pytest.raises(TypeError, match="sise"):
        feed.loader(image_names[:4], batch_size=4, sise=8)
