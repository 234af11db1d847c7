"""pipeline/int8/quantize.py's gate: agreement, decisive images, top-5 overlap, per-class agreement, sample checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.int8.gate import GateThresholds, gate, held_out_figures, pixel_noise, softmax
from pipeline.model.imaging import PreprocessSpec
from pipeline.int8.quantize import QuantizeOptions, side_report_path

CLASSES = 10
LOOSE = GateThresholds(min_held_out=1, min_decisive_images=1, max_class_share=1.0)


def confident(top1: list[int], lead: float = 8.0, classes: int = CLASSES) -> np.ndarray:
    """Logits whose top-1 is ``top1[i]``, far ahead; the rest ordered by class id (a fixed top-5)."""
    logits = np.tile(-np.arange(classes, dtype=np.float64) * 0.01, (len(top1), 1))
    logits[np.arange(len(top1)), top1] += lead
    return logits


def test_identical_logits_agree_everywhere():
    top1 = [i % 4 for i in range(200)]
    result = gate(confident(top1), confident(top1), LOOSE)
    f = result["figures"]
    assert result["passed"] and result["failures"] == []
    assert (f["images"], f["top1_agreement"], f["decisive_agreement"], f["top5_overlap"]) == (200, 1.0, 1.0, 1.0)
    assert f["decisive_images"] == 200 and f["classes_gated"] == 4 and f["distinct_classes"] == 4


def test_one_class_below_the_bar_is_named_with_its_agreement():
    top1 = [i % 4 for i in range(200)]  # 50 images each of classes 0..3
    int8_top1 = list(top1)
    flipped = [i for i in range(200) if top1[i] == 2][:5]  # 5 of class 2's 50 move to class 9
    for i in flipped:
        int8_top1[i] = 9
    labels = [f"c{i}" for i in range(CLASSES)]
    result = gate(confident(top1), confident(int8_top1), LOOSE, labels)
    f = result["figures"]
    assert f["top1_agreement"] == pytest.approx(195 / 200)
    assert f["worst_classes"][0] == {"class_id": 2, "label": "c2", "images": 50, "agreement": pytest.approx(0.9)}
    assert [c["agreement"] for c in f["worst_classes"][1:]] == [1.0, 1.0, 1.0]
    assert "1 class(es) below 95% agreement: c2 90% of 50" in result["failures"]
    assert "decisive-image agreement 97.50% < 99%" in result["failures"]
    assert not result["passed"]


def test_a_class_fp32_itself_flips_under_pixel_noise_is_called_a_near_tie():
    top1 = [i % 4 for i in range(200)]
    int8_top1, noisy_top1 = list(top1), list(top1)
    class2 = [i for i in range(200) if top1[i] == 2]
    for i in class2[:5]:  # INT8 keeps 90 % of class 2
        int8_top1[i] = 9
    for i in class2[-10:]:  # FP32 under pixel noise keeps 80 % of it
        noisy_top1[i] = 8
    labels = [f"c{i}" for i in range(CLASSES)]
    result = gate(confident(top1), confident(int8_top1), LOOSE, labels, confident(noisy_top1))
    assert ("1 class(es) below 95% agreement: c2 90% of 50 (FP32 with pixel noise 80%): near-tie labels, each below "
            "95% for FP32 itself under pixel noise") in result["failures"]
    # A class that only INT8 loses is named without that reading.
    steady = gate(confident(top1), confident(int8_top1), LOOSE, labels, confident(top1))
    assert "1 class(es) below 95% agreement: c2 90% of 50 (FP32 with pixel noise 100%)" in steady["failures"]


def test_classes_with_too_few_images_are_not_gated_alone():
    top1 = [0] * 30 + [1] * 19
    int8_top1 = [0] * 30 + [5] * 19  # class 1 is all wrong, but has 19 < 20 images
    f = gate(confident(top1), confident(int8_top1), LOOSE)["figures"]
    assert [c["class_id"] for c in f["classes"]] == [0]
    assert f["top1_agreement"] == pytest.approx(30 / 49)


def test_near_ties_do_not_count_as_decisive():
    # Image 0: FP32 0.52 vs 0.48 (margin 0.04 < 0.1); image 1: decisive. INT8 flips only the near tie.
    fp32 = np.log(np.array([[0.52, 0.48, 1e-9, 1e-9, 1e-9, 1e-9], [0.9, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]]))
    int8 = np.log(np.array([[0.48, 0.52, 1e-9, 1e-9, 1e-9, 1e-9], [0.85, 0.15, 1e-9, 1e-9, 1e-9, 1e-9]]))
    f = gate(fp32, int8, LOOSE)["figures"]
    assert f["decisive_images"] == 1 and f["decisive_agreement"] == 1.0
    assert f["top1_agreement"] == 0.5


def test_top5_overlap_counts_shared_classes():
    fp32 = np.array([[9, 8, 7, 6, 5, 0, 0, 0.0]])  # top-5: 0..4
    int8 = np.array([[9, 8, 7, 0, 0, 6, 5, 0.1]])  # top-5: 0, 1, 2, 5, 6 (in some order): 3 shared
    assert gate(fp32, int8, LOOSE)["figures"]["top5_overlap"] == pytest.approx(3 / 5)


def test_a_one_class_sample_is_refused_as_too_narrow():
    top1 = [3] * 150
    result = gate(confident(top1), confident(top1), GateThresholds(), [f"c{i}" for i in range(CLASSES)])
    assert result["failures"] == ["100% of the held-out images are one class (c3; at most 50%): the sample must "
                                  "cover the kinds of image the job will see"]


def test_a_small_sample_is_refused_for_its_size():
    top1 = [i % 5 for i in range(40)]
    figures = held_out_figures(confident(top1), GateThresholds())
    result = gate(confident(top1), confident(top1), GateThresholds())
    assert figures == {"images": 40, "decisive_images": 40, "distinct_classes": 5, "largest_class_share": 0.2,
                       "largest_class": "0"}
    assert result["failures"] == [
        "only 40 held-out images (at least 100): give more images or raise --samples",
        "only 40 decisive held-out images (at least 50): give more, and more ordinary, photos",
    ]


def test_softmax_rows_sum_to_one_and_survive_large_logits():
    p = softmax(np.array([[1000.0, 999.0, 0.0], [0.0, 0.0, 0.0]]))
    assert np.allclose(p.sum(axis=1), 1.0)
    assert p[0, 0] == pytest.approx(1 / (1 + np.exp(-1)), rel=1e-6)


def test_mismatched_logits_are_refused():
    with pytest.raises(ValueError, match=r"one shape"):
        gate(np.zeros((3, 4)), np.zeros((3, 5)))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_class_agreement": 1.5}, r"--min-class-agreement 1.5 must be a fraction in \[0, 1\], e.g. 0.95"),
    ({"min_class_images": 0}, r"--min-class-images 0 must be a positive integer, e.g. 20"),
])
def test_bad_thresholds_say_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GateThresholds(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "kl"}, r"--method 'kl' is not one of minmax, entropy, percentile"),
    ({"calibration_images": 4}, r"--calibration-images 4 must be at least 16"),
    ({"types": "s4s4"}, r"--types 's4s4' is not one of s8s8, u8s8, u8u8"),
])
def test_bad_quantize_options_say_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        QuantizeOptions(**kwargs)


def test_the_side_report_lies_beside_the_output():
    assert side_report_path("/data/models/lite0-int8/") == Path("/data/models/lite0-int8.int8_gate.json")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_pixel_noise_moves_each_value_by_at_most_half_a_level_of_its_channel(layout):
    spec = PreprocessSpec(resize_shorter=8, crop=(4, 4), mean=(127.0, 127.0, 127.0), std=(128.0, 64.0, 32.0),
                          layout=layout)
    x = np.zeros((5, *spec.input_shape), np.float32)
    moved = pixel_noise(x, spec, seed=3)
    channel_axis = 1 if layout == "NCHW" else 3
    for c, std in enumerate(spec.std):
        delta = np.abs(np.take(moved - x, c, axis=channel_axis))
        assert delta.max() <= 0.5 / std + 1e-7 and delta.max() > 0.45 / std  # half a level, and about all of it
    assert np.array_equal(moved, pixel_noise(x, spec, seed=3)) and not np.array_equal(moved, pixel_noise(x, spec))


def test_the_pixel_noise_yardstick_counts_what_fp32_flips_against_itself_and_is_never_gated():
    top1 = [i % 4 for i in range(100)]  # 25 images in each of classes 0..3
    noisy = list(top1)
    for i in range(0, 40, 4):  # ten images of class 0 flip under the noise
        noisy[i] = 1
    result = gate(confident(top1), confident(top1), LOOSE, noisy_logits=confident(noisy))
    floor = result["figures"]["fp32_pixel_noise"]
    assert result["passed"] and floor["top1_agreement"] == pytest.approx(0.9)
    assert floor["decisive_agreement"] == pytest.approx(0.9) and floor["top5_overlap"] == 1.0  # the flips keep the same five classes
    by_class = {c["class_id"]: c["fp32_pixel_noise"] for c in result["figures"]["classes"]}
    assert by_class == {0: pytest.approx(15 / 25), 1: 1.0, 2: 1.0, 3: 1.0}
