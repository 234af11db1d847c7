"""pipeline/quantize.py's node choices on a small real ONNX model: the exclusion keywords, and the benchmarks'
per-layer error and ``exclude_worst`` (tests/benchmarks/int8_layers.py), each quantized by ONNX Runtime's own
tooling."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.int8.quantize import QuantizeOptions, quantize_onnx
from pipeline.int8.quantize_nodes import resolve_exclusions
from support.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
from int8_layers import check_worst, layer_errors, quantize_excluding_worst  # noqa: E402

WEIGHTED = ["stem", "dw1", "pw1", "dw2", "head", "fc"]


def tiny_net(path: Path, *, loud: str | None = None) -> Path:
    """stem conv -> depthwise -> pointwise -> depthwise -> head conv (each + ReLU6) -> pool -> flatten -> fc.

    ``loud``: the name of the conv whose weights get one output channel 300x the others', so that one weight scale
    per tensor (``per_channel=False``) rounds its other channels' weights to zero: the node that adds the most
    error.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits, nodes = [], []
    shapes = {"stem": (8, 3, 3, 3), "dw1": (8, 1, 3, 3), "pw1": (16, 8, 1, 1), "dw2": (16, 1, 3, 3),
              "head": (32, 16, 1, 1)}
    groups = {"dw1": 8, "dw2": 16}
    x = "input"
    inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "lo"))
    inits.append(numpy_helper.from_array(np.array(6.0, np.float32), "hi"))
    for name, shape in shapes.items():
        w = rng.normal(0, 0.5, shape).astype(np.float32)
        if name == loud:
            w[0] *= 300.0
        inits.append(numpy_helper.from_array(w, f"{name}_w"))
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, shape[0]).astype(np.float32), f"{name}_b"))
        nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [f"{name}_out"], name=name,
                                      pads=[1, 1, 1, 1] if shape[2] == 3 else [0, 0, 0, 0],
                                      group=groups.get(name, 1)))
        nodes.append(helper.make_node("Clip", [f"{name}_out", "lo", "hi"], [f"{name}_act"], name=f"{name}_relu6"))
        x = f"{name}_act"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["features"], name="flatten"))
    inits.append(numpy_helper.from_array(rng.normal(0, 0.2, (10, 32)).astype(np.float32), "fc_w"))
    inits.append(numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"))
    nodes.append(helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                            [None, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def calibration(n: int = 32) -> np.ndarray:
    return np.random.default_rng(1).uniform(-1, 1, (n, 3, 16, 16)).astype(np.float32)


def float_weights(path: Path) -> set[str]:
    """Weighted nodes of a QDQ model whose weight is still a float initializer (not behind a DequantizeLinear)."""
    import onnx

    graph = onnx.load(str(path)).graph
    floats = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    return {n.name for n in graph.node if n.op_type in ("Conv", "Gemm") and n.input[1] in floats}


def test_keywords_find_the_stem_head_depthwise_pool_and_classifier(tmp_path):
    net = tiny_net(tmp_path / "net.onnx")
    assert resolve_exclusions(net, ["depthwise"]) == ["dw1", "dw2"]
    assert resolve_exclusions(net, ["stem", "head", "classifier", "pool"]) == ["fc", "head", "pool", "stem"]
    assert resolve_exclusions(net, ["pw1", "depthwise", "dw1"]) == ["dw1", "dw2", "pw1"]


def test_depthwise_on_a_net_without_grouped_convs_says_the_fix(tmp_path):
    import onnx

    net = tiny_net(tmp_path / "net.onnx")
    model = onnx.load(str(net))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "group":
                attr.i = 1
    onnx.save(model, str(net))
    with pytest.raises(ConfigError, match=r"--exclude depthwise: .* has no grouped conv; drop it from --exclude"):
        resolve_exclusions(net, ["depthwise"])


def test_excluded_depthwise_convs_keep_float_weights(tmp_path):
    net = tiny_net(tmp_path / "net.onnx")
    out = tmp_path / "int8.onnx"
    method = quantize_onnx(net, out, "input", calibration(), QuantizeOptions(exclude=("classifier", "depthwise"),
                                                                           calibration_images=16))
    assert method["nodes_to_exclude"] == ["dw1", "dw2", "fc"]
    assert float_weights(out) == {"dw1", "dw2", "fc"}


def test_layer_errors_rank_every_weighted_node_and_find_the_loud_one(tmp_path):
    net = tiny_net(tmp_path / "net.onnx", loud="pw1")
    qdq = tmp_path / "int8.onnx"
    quantize_onnx(net, qdq, "input", calibration(), QuantizeOptions(exclude=(), per_channel=False,
                                                                     calibration_images=16))
    errors = layer_errors(net, qdq, "input", calibration(16))
    assert sorted(e["node"] for e in errors) == sorted(WEIGHTED)
    added = [e["added_noise"] for e in errors]
    assert added == sorted(added, reverse=True)
    assert errors[0]["node"] == "pw1" and errors[0]["output_sqnr_db"] < errors[0]["input_sqnr_db"] - 10
    assert added[0] > 2 * added[1]


def test_exclude_worst_leaves_the_largest_errors_in_float_and_says_which(tmp_path):
    net = tiny_net(tmp_path / "net.onnx", loud="pw1")
    out = tmp_path / "int8.onnx"
    method = quantize_excluding_worst(net, out, "input", calibration(),
                                      QuantizeOptions(exclude=("classifier",), per_channel=False,
                                                      calibration_images=16), 1)
    assert [w["node"] for w in method["worst_nodes"]] == ["pw1"]
    assert method["nodes_to_exclude"] == ["fc", "pw1"] and method["exclude_worst"] == 1
    assert float_weights(out) == {"fc", "pw1"}


def test_exclude_worst_must_be_a_count():
    with pytest.raises(ConfigError, match=r"exclude_worst -1 must be a number of nodes, 0 or more, e.g. 4"):
        check_worst(-1)


def test_extra_options_reach_onnx_runtime(tmp_path):
    import onnx
    from onnx import numpy_helper

    net = tiny_net(tmp_path / "net.onnx")
    skewed = calibration() * 0.6 + 0.4  # inputs in [-0.2, 1]: a min-max range not centred on 0
    zero_points = {}
    for name, extra in (("plain", ()), ("symmetric", (("ActivationSymmetric", True),))):
        out = tmp_path / f"{name}.onnx"
        method = quantize_onnx(net, out, "input", skewed, QuantizeOptions(calibration_images=16),
                               extra_options=dict(extra))
        assert method["extra_options"] == dict(extra)
        inits = {i.name: i for i in onnx.load(str(out)).graph.initializer}
        zero_points[name] = int(numpy_helper.to_array(inits["input_zero_point"]))
    # u8 activations: symmetric ranges put the zero point at the middle of the range, min-max ones wherever 0 falls.
    assert zero_points["symmetric"] == 128 and zero_points["plain"] != 128
