"""The default network's layouts (tests/benchmarks/lite0_layouts.py, the library's pipeline.gpu.lite0 among them): TF
"SAME" padding folded into the
convs computes what the explicit pads compute, on real photos and the parity inputs, in FP32 on the CPU."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from pipeline.model.default_model import DEFAULT_SPEC, IMAGE_SIZE, LITE0_BLOCKS
from pipeline.errors import EngineError
from pipeline.model.imaging import decode_image, load_and_preprocess, normalize_array
from pipeline.model.folder import load_model
from support.paths import BENCHMARKS, DATA

sys.path.insert(0, str(BENCHMARKS))
from lite0_layouts import (  # noqa: E402
    DEFAULT_LITE0_LAYOUT,
    LITE0_LAYOUTS,
    REFERENCE_LITE0_LAYOUT,
    Lite0Layout,
    PadPlan,
    layout_network,
    pad_plan,
)

# FP32 on the CPU the layouts gave bit-identical logits (torch 2.13, the photos and all 200 parity inputs); the bound
# leaves room for a backend that sums the zero taps or the larger padding in another order.
MAX_LOGIT_DIFF = 1e-4
PARITY_INPUTS = 8


def _conv_shapes() -> list[tuple[int, int, int]]:
    """(input size, kernel, stride) of every spatial conv of Lite0 at 224 px: the stem, then each depthwise conv."""
    shapes, size = [(IMAGE_SIZE, 3, 2)], -(-IMAGE_SIZE // 2)
    for repeats, kernel, stride, *_ in LITE0_BLOCKS:
        for r in range(repeats):
            s = stride if r == 0 else 1
            shapes.append((size, kernel, s))
            size = -(-size // s)
    return shapes


def test_pad_plans_of_lite0_at_224():
    shapes = _conv_shapes()
    assert len(shapes) == 17
    asymmetric = [(n, k) for n, k, s in shapes if s == 2]
    assert asymmetric == [(224, 3), (112, 3), (56, 5), (28, 3), (14, 5)]
    # TF pads (0, 1) for 3x3 and (1, 2) for 5x5 at stride 2 on an even size: one zero tap, padding = the larger side
    assert pad_plan(224, 3, 2, "kernel") == PadPlan(None, 1, 1, 0)
    assert pad_plan(56, 5, 2, "kernel") == PadPlan(None, 2, 1, 0)
    assert pad_plan(112, 3, 2, "slice") == PadPlan(None, 2, 0, 1)
    assert pad_plan(14, 5, 2, "slice") == PadPlan(None, 3, 0, 1)
    assert pad_plan(56, 5, 2, "pad") == PadPlan((1, 2, 1, 2), 0, 0, 0)
    assert pad_plan(224, 3, 2, "mirror") == PadPlan(None, 1, 0, 0)  # turned by 180 degrees, the larger pad in front
    assert pad_plan(56, 5, 2, "mirror") == PadPlan(None, 2, 0, 0)
    for n, k, s in shapes:
        if s == 1:  # stride 1, odd kernel: symmetric, into the conv
            assert pad_plan(n, k, s, "conv") == PadPlan(None, k // 2, 0, 0)
            assert pad_plan(n, k, s, "pad") == PadPlan((k // 2,) * 4, 0, 0, 0)
    with pytest.raises(ValueError, match="cannot make the asymmetric pads"):
        pad_plan(224, 3, 2, "conv")


def test_layout_fields_are_checked():
    with pytest.raises(ValueError, match="Lite0Layout.asymmetric 'conv': use one of pad, kernel, slice, mirror"):
        Lite0Layout(symmetric="conv", asymmetric="conv", stem="pad", inplace=False)
    with pytest.raises(ValueError, match='"mirror" turns the whole network: set asymmetric and stem to "mirror"'):
        Lite0Layout(symmetric="conv", asymmetric="mirror", stem="kernel", inplace=False)
    with pytest.raises(ValueError, match='and symmetric to "conv"'):
        Lite0Layout(symmetric="pad", asymmetric="mirror", stem="mirror", inplace=False)
    assert REFERENCE_LITE0_LAYOUT in LITE0_LAYOUTS and DEFAULT_LITE0_LAYOUT in LITE0_LAYOUTS
    reference = LITE0_LAYOUTS[REFERENCE_LITE0_LAYOUT]
    assert (reference.symmetric, reference.asymmetric, reference.stem) == ("pad", "pad", "pad")
    default = LITE0_LAYOUTS[DEFAULT_LITE0_LAYOUT]
    assert "pad" not in (default.symmetric, default.asymmetric, default.stem)  # no pad kernel left


def _tf_same_cases(extra: set, seed: int):
    """(n, k, s, groups, x, w, TF "SAME" reference: F.pad + conv) over every Lite0 shape and ``extra`` ones."""
    torch = pytest.importorskip("torch")
    from torch.nn import functional as F

    gen = torch.Generator().manual_seed(seed)
    for n, k, s in sorted({*_conv_shapes(), *extra}):
        for groups in (1, 4):
            x = torch.randn(2, 4, n, n, generator=gen)
            w = torch.randn(4, 4 // groups, k, k, generator=gen)
            plan_pad = pad_plan(n, k, s, "pad")
            ref = F.conv2d(F.pad(x, plan_pad.pad) if plan_pad.pad else x, w, stride=s, padding=plan_pad.padding,
                           groups=groups)
            yield n, k, s, groups, x, w, ref


@pytest.mark.parametrize("form", ["kernel", "slice"])
def test_each_plan_equals_tf_same_padding_on_random_tensors(form):
    """Every Lite0 shape, and odd sizes too, with random weights: the plan's conv (and slice) equals F.pad + conv."""
    pytest.importorskip("torch")
    from torch.nn import functional as F

    for n, k, s, groups, x, w, ref in _tf_same_cases({(15, 3, 2), (15, 5, 2), (57, 5, 2), (9, 3, 1)}, seed=0):
        plan = pad_plan(n, k, s, form if s == 2 else "conv")
        wk = F.pad(w, (plan.front_taps, 0, plan.front_taps, 0))
        got = F.conv2d(x, wk, stride=s, padding=plan.padding, groups=groups)
        got = got[:, :, plan.drop : plan.drop + ref.shape[2], plan.drop : plan.drop + ref.shape[3]]
        assert got.shape == ref.shape, (n, k, s)
        assert (got - ref).abs().max().item() < 1e-4, (n, k, s, groups)


def test_the_mirror_plan_equals_tf_same_padding_on_the_turned_input():
    """Every Lite0 shape, odd sizes and stride 3 too, random weights: turning input and kernel by 180 degrees, the
    conv with its own padding, turned back, equals F.pad + conv."""
    pytest.importorskip("torch")
    from torch.nn import functional as F

    extra = {(15, 3, 2), (15, 5, 2), (57, 5, 2), (9, 3, 1), (10, 5, 3), (11, 3, 3)}
    for n, k, s, groups, x, w, ref in _tf_same_cases(extra, seed=1):
        plan = pad_plan(n, k, s, "mirror")
        got = F.conv2d(x.flip(2, 3), w.flip(2, 3), stride=s, padding=plan.padding, groups=groups).flip(2, 3)
        assert got.shape == ref.shape, (n, k, s)
        assert (got - ref).abs().max().item() < 1e-4, (n, k, s, groups)


@pytest.fixture(scope="module")
def weights():
    pytest.importorskip("torch")
    from pipeline.model.default_model import load_checkpoint

    return load_checkpoint()


@pytest.fixture(scope="module")
def inputs() -> np.ndarray:
    """The committed photos (whole reference preprocessing) and 8 of the parity inputs (already 224 px)."""
    photos = [load_and_preprocess(p.read_bytes(), DEFAULT_SPEC)[0] for p in sorted((DATA / "photos").glob("*.jpg"))]
    parity = [normalize_array(np.asarray(decode_image(p.read_bytes())), DEFAULT_SPEC)
              for p in sorted((DATA / "parity" / "inputs").glob("*.jpg"))[:PARITY_INPUTS]]
    assert len(photos) >= 10 and len(parity) == PARITY_INPUTS
    return np.stack(photos + parity)


@pytest.fixture(scope="module")
def reference_logits(weights, inputs):
    torch = pytest.importorskip("torch")

    with torch.inference_mode():
        return layout_network(weights, REFERENCE_LITE0_LAYOUT)(torch.from_numpy(inputs)).numpy()


def test_the_reference_layout_matches_the_original_torch_model(inputs, reference_logits):
    """The explicit layout against the package's own torch model's logits on the parity inputs
    (tests/data/parity/torch_logits.npz, made by tests/data/make_parity_fixture.py)."""
    fixture = np.load(DATA / "parity" / "torch_logits.npz")
    got, want = reference_logits[-PARITY_INPUTS:], fixture["logits"][:PARITY_INPUTS]
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(1) == want.argmax(1)).all()


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n == DEFAULT_LITE0_LAYOUT else pytest.mark.slow)
    for n in LITE0_LAYOUTS if n != REFERENCE_LITE0_LAYOUT
])
def test_each_layout_gives_the_reference_logits(name, weights, inputs, reference_logits):
    torch = pytest.importorskip("torch")
    from pipeline.gpu.lite0 import Lite0

    net = layout_network(weights, name)
    if name == DEFAULT_LITE0_LAYOUT:
        assert isinstance(net, Lite0)  # the library's network, the one the GPU paths run
    else:
        assert net.layout == LITE0_LAYOUTS[name]
    with torch.inference_mode():
        got = net(torch.from_numpy(inputs)).numpy()
    assert np.abs(got - reference_logits).max() < MAX_LOGIT_DIFF
    assert (got.argmax(1) == reference_logits.argmax(1)).all()


def test_the_default_layout_in_channels_last_as_the_engine_runs_it(weights, inputs, reference_logits):
    """TopKNetwork's copy (channels-last, FP32 on the CPU): the slices and in-place activations keep the logits."""
    torch = pytest.importorskip("torch")
    from pipeline.gpu.networks import efficientnet_lite0
    from pipeline.gpu.topk_network import TopKNetwork

    tk = TopKNetwork(efficientnet_lite0(weights), crop=DEFAULT_SPEC.crop, device=torch.device("cpu"), half=False,
                     batch_size=8, cuda_graph=False, top_k=5)
    x = torch.from_numpy(inputs).contiguous(memory_format=torch.channels_last)
    got = tk.run(x).numpy()
    assert np.abs(got - reference_logits).max() < MAX_LOGIT_DIFF
    scores, ids = tk.scores(x)
    assert (ids[:, 0].numpy() == reference_logits.argmax(1)).all()


def test_the_gemm_layout_cut_into_several_gemms_gives_the_reference_logits(weights, inputs, reference_logits,
                                                                         monkeypatch):
    """GEMMs past ``GEMM_ROWS`` rows are cut; the pieces together give the same logits as one GEMM (channels-last)."""
    torch = pytest.importorskip("torch")
    from pipeline.gpu import lite0, networks

    monkeypatch.setattr(lite0, "GEMM_ROWS", 1000)  # the 112x112 layers of these inputs: many pieces
    net = networks.efficientnet_lite0(weights).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        got = net(torch.from_numpy(inputs).contiguous(memory_format=torch.channels_last)).numpy()
    assert np.abs(got - reference_logits).max() < MAX_LOGIT_DIFF
    assert (got.argmax(1) == reference_logits.argmax(1)).all()


def test_the_gemm_layout_folds_every_depthwise_bias(weights):
    """No depthwise conv keeps a bias, and every 1x1 conv is a GEMM: no bias pass is left but the stem's."""
    torch = pytest.importorskip("torch")
    from pipeline.gpu.networks import efficientnet_lite0

    net = efficientnet_lite0(weights)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 1 + 16  # the stem and one depthwise conv per block
    assert convs[0].bias is not None and all(c.bias is None for c in convs[1:])


def test_kernel_layout_keeps_the_checkpoint_weights(weights):
    """The zero taps go in front; the folded checkpoint weights are the rest, unchanged."""
    pytest.importorskip("torch")
    from pipeline.gpu.lite0 import fold_bn as _fold

    net = layout_network(weights, "kernel")
    stem = net.stem.conv.weight.detach().numpy()
    w, b = _fold(weights, "_conv_stem", "_bn0")
    assert stem.shape == (32, 3, 4, 4) and (stem[:, :, 0, :] == 0).all() and (stem[:, :, :, 0] == 0).all()
    assert np.array_equal(stem[:, :, 1:, 1:], w) and np.array_equal(net.stem.conv.bias.detach().numpy(), b)
    dw = net.blocks[1].body[1].conv  # the first stride-2 depthwise conv
    w, _ = _fold(weights, "_blocks.1._depthwise_conv", "_blocks.1._bn1")
    assert dw.stride == (2, 2) and dw.padding == (1, 1)
    assert np.array_equal(dw.weight.detach().numpy()[:, :, 1:, 1:], w)


def test_both_gpu_paths_load_the_default_layout(tmp_path):
    """The in-process engine (a ModelBundle) and the gpu profile's Triton models (a version folder) get one network."""
    pytest.importorskip("torch")
    from pipeline.gpu.lite0 import Lite0
    from pipeline.gpu.networks import load_network
    from pipeline.triton.serve.gpu_model import _FolderBundle

    assert isinstance(load_network(load_model(None)), Lite0)
    assert isinstance(load_network(_FolderBundle(tmp_path, DEFAULT_SPEC, 1000), "auto"), Lite0)


def test_a_layout_name_loads_the_default_model_in_that_layout(monkeypatch):
    """The benchmarks' networks (tests/benchmarks/gpu_networks.py) through the library's registry."""
    pytest.importorskip("torch")
    from pipeline.gpu import networks
    from pipeline.gpu.networks import load_network

    monkeypatch.setattr(networks, "_NETWORKS", {})
    with pytest.raises(EngineError, match="unknown network 'mirror'; leave it unset, or use one of the networks "
                                          "registered with register_network"):
        load_network(load_model(None), "mirror")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_networks

    gpu_networks.register()
    assert load_network(load_model(None), "mirror").layout == LITE0_LAYOUTS["mirror"]
    with pytest.raises(EngineError, match="unknown network 'nope'; leave it unset, or use one of resnet50, explicit"):
        load_network(load_model(None), "nope")


def test_an_unknown_layout_names_the_known_ones(weights):
    pytest.importorskip("torch")

    with pytest.raises(EngineError, match="unknown EfficientNet-Lite0 layout 'fast'; use one of explicit, "):
        layout_network(weights, "fast")


@pytest.mark.slow
def test_bench_network_runs_on_the_cpu(monkeypatch, capsys, tmp_path):
    """tests/benchmarks/bench_network.py --device cpu --quick, cut down: its table and answer lines, checked here so
    that the one device call is not spent finding its bugs; an unknown layout is its own error row."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_network

    assert bench_network.main(["--device", "cpu", "--quick", "--no-timm", "--batches", "2", "--count", "4",
                               "--layouts", f"{REFERENCE_LITE0_LAYOUT},{DEFAULT_LITE0_LAYOUT},nope",
                               "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert set(table) >= {REFERENCE_LITE0_LAYOUT, f"{DEFAULT_LITE0_LAYOUT} (default)", "nope"}
    assert "EngineError: unknown EfficientNet-Lite0 layout 'nope'" in table["nope"]
    assert f"default layout {DEFAULT_LITE0_LAYOUT}: " in out and "top-1 100.00% (goal 99%: met)" in out
    rows = {r["network"]: r for r in json.loads((tmp_path / "bench_network.json").read_text())["rows"]}
    default = rows[DEFAULT_LITE0_LAYOUT]
    assert not default["error"] and default["img_s"]["2"] > 0
    assert default["cpu_fp32_max_diff"] < MAX_LOGIT_DIFF and default["device_fp32_max_diff"] < MAX_LOGIT_DIFF
    assert default["device_fp32_vs_onnx_max_diff"] < 1e-3
    assert default["parity"]["agree"] == 1.0 and default["parity"]["margins"] == []
