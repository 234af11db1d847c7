"""A small ONNX classifier with an embedding, built with onnx.helper: the mean colour of each quadrant of the image
(12 values) is a second graph output declared as the model's embedding, and the mean colour of the whole image goes
through a Gemm to the class logits, so both answers depend on the pixels and the weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE

CLASSES = 5
SIZE = 32
GRID = 2  # quadrants per side
DIM = 3 * GRID * GRID
INPUT, LOGITS, EMBEDDING = "image", "logits", "colour_grid"
LABELS = ("red", "green", "blue", "dark", "light")
# Pixels centred on mid-grey, so the quadrant colours point in all directions and cosine similarity tells them apart.
SPEC = {"resize_shorter": SIZE, "crop": [SIZE, SIZE], "interpolation": "bilinear", "scale": 1 / 255,
        "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
        "embedding": {"output": EMBEDDING, "dim": DIM, "normalize": True}}


def network(*, seed: int = 1):
    """The ModelProto: outputs LOGITS (batch, CLASSES) and EMBEDDING (batch, DIM), not normalised."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.normal(0, 4, (CLASSES, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 1, CLASSES).astype(np.float32), "b")]
    cell = SIZE // GRID
    nodes = [helper.make_node("AveragePool", [INPUT], ["grid"], kernel_shape=[cell, cell], strides=[cell, cell]),
             helper.make_node("Flatten", ["grid"], [EMBEDDING]),
             helper.make_node("GlobalAveragePool", [INPUT], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w", "b"], [LOGITS], transB=1)]
    graph = helper.make_graph(
        nodes, "colour_grid", [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["batch", CLASSES]),
         helper.make_tensor_value_info(EMBEDDING, TensorProto.FLOAT, ["batch", DIM])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def embedding_folder(folder: Path, *, seed: int = 1) -> Path:
    """A model folder of ``network(seed=seed)`` with its embedding declared in preprocess.json."""
    import onnx

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(network(seed=seed), str(folder / MODEL_FILE))
    (folder / LABELS_FILE).write_text("".join(f"{label}\n" for label in LABELS), encoding="utf-8")
    (folder / SPEC_FILE).write_text(json.dumps(SPEC), encoding="utf-8")
    return folder
