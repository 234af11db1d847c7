"""Reference decoding and preprocessing: spec as data, geometry, value range, odd inputs, limits."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
from PIL import Image

from support.oddities import EXPECTED_SIZES, bomb_png, encode, exif_rotated_jpeg, oddities, photo
from pipeline.model.default_model import DEFAULT_SPEC, spec_path
from pipeline.errors import ImageError, ModelError
from pipeline.model.imaging import (
    DecodeLimits,
    PreprocessSpec,
    decode_image,
    load_and_preprocess,
    normalize_array,
    preprocess_image,
)


def test_default_spec_is_the_tf_efficientnet_lite_eval_recipe():
    data = json.loads(spec_path().read_text())
    assert data == {
        "resize_shorter": 256,  # 224 + CROP_PADDING 32
        "interpolation": "bicubic",
        "antialias": True,
        "crop": [224, 224],
        "channel_order": "RGB",
        "scale": 1.0,
        "mean": [127.0, 127.0, 127.0],
        "std": [128.0, 128.0, 128.0],
        "layout": "NCHW",
    }
    assert PreprocessSpec.from_dict(data) == DEFAULT_SPEC


def test_spec_round_trips_through_json_and_dict():
    spec = PreprocessSpec(resize_shorter=320, crop=(288, 256), channel_order="BGR", scale=1 / 255,
                          mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), layout="NHWC")
    assert PreprocessSpec.from_json(spec.to_json()) == spec
    assert PreprocessSpec.from_dict(spec.to_dict()) == spec
    assert spec.input_shape == (288, 256, 3)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"colour": "RGB"}, r"unknown field\(s\) colour; allowed: "),
        ({"interpolation": "sinc"}, r"interpolation must be one of nearest, bilinear, bicubic, lanczos, got 'sinc'"),
        ({"crop": [300, 300]}, r"crop \[300, 300\] must fit inside resize_shorter 256"),
        ({"std": [1.0, 0.0, 1.0]}, r"std must have 3 positive values"),
        ({"layout": "CHW"}, r"layout must be one of NCHW, NHWC, got 'CHW'"),
        ({"antialias": False}, r"antialias false is only supported with interpolation 'nearest'"),
    ],
)
def test_bad_spec_fields_say_what_and_how(change, message):
    data = {**DEFAULT_SPEC.to_dict(), **change}
    with pytest.raises(ModelError, match=message):
        PreprocessSpec.from_dict(data)


def test_spec_needs_resize_shorter_and_valid_json():
    with pytest.raises(ModelError, match="'resize_shorter' is required"):
        PreprocessSpec.from_dict({"crop": [224, 224]})
    with pytest.raises(ModelError, match="not valid JSON"):
        PreprocessSpec.from_json("{resize_shorter: 256")


def test_values_follow_mean_and_std_exactly():
    # A flat image stays flat through any resize: 127 -> 0, 255 -> 1, 0 -> -127/128.
    for value, expected in ((127, 0.0), (255, 1.0), (0, -127 / 128)):
        x = preprocess_image(Image.new("RGB", (500, 375), (value,) * 3), DEFAULT_SPEC)
        assert x.shape == (3, 224, 224) and x.dtype == np.float32
        np.testing.assert_allclose(x, expected, atol=1e-7)


def test_channel_order_and_layout():
    img = Image.new("RGB", (300, 300), (255, 0, 0))
    rgb = preprocess_image(img, DEFAULT_SPEC)
    assert rgb[0].min() == 1.0 and rgb[2].max() < 0  # channel 0 is red in NCHW
    bgr_nhwc = PreprocessSpec(**{**DEFAULT_SPEC.to_dict(), "channel_order": "BGR", "layout": "NHWC"})
    out = preprocess_image(img, bgr_nhwc)
    assert out.shape == (224, 224, 3)
    np.testing.assert_array_equal(out, rgb.transpose(1, 2, 0)[:, :, ::-1])


def test_centre_crop_of_a_wide_image_takes_its_middle():
    # 1200x300: three vertical bands; the crop (224 of 1024 wide after scaling) sees only the middle band.
    arr = np.zeros((300, 1200, 3), np.uint8)
    arr[:, :400] = (255, 0, 0)
    arr[:, 400:800] = (0, 255, 0)
    arr[:, 800:] = (0, 0, 255)
    x = preprocess_image(Image.fromarray(arr), DEFAULT_SPEC)
    np.testing.assert_allclose(x[1], 1.0, atol=1e-6)
    np.testing.assert_allclose(x[0], -127 / 128, atol=1e-6)


def test_exact_scale_box_equals_resize_then_crop_when_sizes_are_whole():
    # 600x400 -> shorter side 256 is exactly 384x256; centre crop 224 starts at (80, 16): both ways must agree.
    img = photo("coffee").resize((600, 400))
    ours = preprocess_image(img, DEFAULT_SPEC)
    two_step = img.resize((384, 256), Image.Resampling.BICUBIC).crop((80, 16, 304, 240))
    np.testing.assert_array_equal(ours, normalize_array(np.asarray(two_step), DEFAULT_SPEC))


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize("size", [(150, 400), (400, 150), (700, 900), (180, 240)])
def test_resampling_is_a_horizontal_then_a_vertical_pass_on_every_pillow(size, interpolation):
    # Pillow 13 runs one resize call vertical-first on tall images (python-pillow/Pillow#9549); the reference and DALI
    # both make the horizontal pass first, rounded to 8 bits. Noise makes any other order show.
    spec = PreprocessSpec(resize_shorter=256, interpolation=interpolation)
    w, h = size
    img = Image.fromarray(np.random.default_rng(w + h).integers(0, 256, (h, w, 3), dtype=np.uint8))
    box = 224 * min(w, h) / 256
    left, top = (w - box) / 2, (h - box) / 2
    filt = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
            "lanczos": Image.Resampling.LANCZOS}[interpolation]
    horizontal = img.resize((224, h), filt, box=(left, 0, left + box, h))
    both = horizontal.resize((224, 224), filt, box=(0, top, 224, top + box))
    np.testing.assert_array_equal(preprocess_image(img, spec), normalize_array(np.asarray(both), spec))


def test_exif_orientation_is_applied():
    upright = np.asarray(photo("chelsea"), dtype=np.int16)
    rotated = decode_image(exif_rotated_jpeg())
    assert rotated.size == (451, 300)
    assert np.abs(np.asarray(rotated, dtype=np.int16) - upright).mean() < 3  # only JPEG re-encoding noise


def test_rgba_is_composited_on_white():
    img = Image.new("RGBA", (64, 48), (10, 20, 30, 0))  # fully transparent dark pixels
    img.paste((200, 0, 0, 255), (16, 12, 48, 36))
    rgb = np.asarray(decode_image(encode(img, "PNG")))
    assert tuple(rgb[0, 0]) == (255, 255, 255)
    assert tuple(rgb[24, 32]) == (200, 0, 0)


def test_16_bit_gray_is_scaled_not_clipped():
    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (16, 1))
    rgb = np.asarray(decode_image(encode(Image.fromarray(ramp), "PNG")))
    assert rgb.shape == (16, 256, 3)
    assert rgb[0, 0, 0] == 0 and rgb[0, -1, 0] == 255 and 120 <= rgb[0, 128, 0] <= 135


def test_cmyk_and_gray_become_rgb_close_to_the_original():
    cat = np.asarray(photo("chelsea"), dtype=np.int16)
    cmyk = np.asarray(decode_image(encode(photo("chelsea").convert("CMYK"), "JPEG", quality=95)), dtype=np.int16)
    assert np.abs(cmyk - cat).mean() < 4
    gray = np.asarray(decode_image(encode(photo("chelsea").convert("L"), "PNG")))
    assert gray.shape == (300, 451, 3) and (gray[..., 0] == gray[..., 2]).all()


@pytest.mark.parametrize("name", sorted(oddities()))
def test_each_odd_input_decodes_or_fails_with_its_kind(name):
    data, status, kind = oddities()[name]
    if status == "ok":
        x, width, height = load_and_preprocess(data, DEFAULT_SPEC)
        assert x.shape == (3, 224, 224) and np.isfinite(x).all()
        assert -1.0 <= x.min() and x.max() <= 1.0
        if name in EXPECTED_SIZES:
            assert (width, height) == EXPECTED_SIZES[name]
    else:
        with pytest.raises(ImageError) as info:
            load_and_preprocess(data, DEFAULT_SPEC)
        assert info.value.kind == kind
        assert str(info.value).startswith(f"{kind}: ")


def test_byte_cap():
    data = encode(photo("chelsea"), "JPEG")
    with pytest.raises(ImageError, match=rf"too_large: {len(data)} bytes is over max_bytes=1000; raise the limit"):
        decode_image(data, DecodeLimits(max_bytes=1000))


def test_pixel_cap_is_checked_from_the_header_before_decoding():
    data = encode(photo("chelsea"), "JPEG")
    with pytest.raises(ImageError, match=r"too_many_pixels: 451x300 = 135300 pixels is over max_pixels=100000"):
        decode_image(data, DecodeLimits(max_pixels=100_000))
    assert decode_image(data, DecodeLimits(max_pixels=135_300)).size == (451, 300)


def test_decompression_bomb_is_refused_quickly():
    data = bomb_png()
    assert len(data) < 400_000
    start = time.perf_counter()
    # the default cap, then one above Pillow's own limit (which follows ours) but below the bomb's 1.6 G pixels
    for limits in (DecodeLimits(), DecodeLimits(max_pixels=10**9)):
        with pytest.raises(ImageError) as info:
            decode_image(data, limits)
        assert info.value.kind == "too_many_pixels"
    assert time.perf_counter() - start < 2.0


def test_multi_frame_uses_the_first_frame():
    frames = [Image.new("RGB", (40, 30), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    rgb = np.asarray(decode_image(buf.getvalue()))
    assert rgb[..., 0].mean() > 200 and rgb[..., 2].mean() < 50


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("order", ["RGB", "BGR"])
def test_table_lookup_normalization_is_bit_identical_to_the_arithmetic(layout, order):
    import dataclasses

    spec = dataclasses.replace(DEFAULT_SPEC, layout=layout, channel_order=order, scale=1 / 255.0,
                               mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    rgb = np.random.default_rng(3).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    rgb[0, :3] = [[0, 0, 0], [255, 255, 255], [1, 128, 254]]  # both ends of the range
    got = normalize_array(rgb, spec)
    arithmetic = (rgb[:, :, ::-1] if order == "BGR" else rgb).astype(np.float32)
    want = (arithmetic * np.float32(spec.scale) - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    want = want.transpose(2, 0, 1) if layout == "NCHW" else want
    assert got.dtype == np.float32 and got.flags.c_contiguous and got.shape == want.shape
    assert np.array_equal(got, want)  # exactly, not approximately
    assert np.array_equal(normalize_array(rgb.astype(np.float32), spec), want)  # the float path agrees


@pytest.mark.parametrize("size, shorter", [(32, 253), (224, 374), (384, 482)])
def test_a_crop_as_large_as_resize_shorter_spans_the_shorter_side_of_every_size(size, shorter):
    """crop == resize_shorter (timm's crop_pct 1, a processor whose shortest_edge is its crop): the box is the whole
    shorter side; dividing by the scale factor first overshot it by an ulp for these sizes, which Pillow refused."""
    spec = PreprocessSpec(resize_shorter=size, crop=size)
    for width, height in ((shorter + 67, shorter), (shorter, shorter + 67)):
        x = preprocess_image(Image.new("RGB", (width, height), (90, 120, 200)), spec)
        assert x.shape == (3, size, size) and np.allclose(x[:, 0, 0], [90, 120, 200])
