"""Small ONNX classifiers built with onnx.helper, each with one trait a user's export may have: external weights, a
log-softmax or sigmoid head, a channels-last fully dynamic input, one gray channel, outputs that turn NaN or infinite
on bright images, an embedding output that does. Each is the mean colour of the image through a Gemm (its answers
depend on its weights)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE

CLASSES = 5
SIZE = 32
INPUT, OUTPUT = "image", "logits"
# Pixels 0..1, so the mean colour is the image's brightness.
SPEC = {"resize_shorter": SIZE, "crop": [SIZE, SIZE], "interpolation": "bilinear", "scale": 1 / 255,
        "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
# The "nonfinite" network answers infinity for images brighter than BRIGHT (mean of all pixels, 0..1) and NaN for
# those brighter than BRIGHTER: none of the photos (the brightest is 0.63), so a GPU conversion checked on them
# converts; BRIGHT_IMAGES are a light gray one (infinity) and a white one (NaN).
BRIGHT, BRIGHTER = 0.8, 0.9
BRIGHT_IMAGES = {"light.png": 217, "white.png": 255}  # name -> the gray level of every pixel
EXTERNAL_DATA = MODEL_FILE + ".data"
# The head after the logits, or what the network's input is; "nonfinite_embedding" has finite logits and an
# intermediate tensor EMBEDDING (EMBEDDING_DIM wide, declared by EMBEDDING_SPEC) that turns infinite or NaN where
# "nonfinite"'s logits do.
KINDS = ("logits", "log_softmax", "softmax", "sigmoid", "nonfinite", "nhwc_dynamic", "gray", "nonfinite_embedding")
EMBEDDING, EMBEDDING_DIM = "features", 4
EMBEDDING_SPEC = {**SPEC, "embedding": {"output": EMBEDDING, "dim": EMBEDDING_DIM, "normalize": True}}


def network(kind: str = "logits", *, seed: int = 1, classes: int = CLASSES):
    """The ModelProto of ``kind`` (one of KINDS)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    channels = 1 if kind == "gray" else 3
    inits = [numpy_helper.from_array(rng.normal(0, 4, (classes, channels)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 1, classes).astype(np.float32), "b")]
    nodes = []
    x = INPUT
    shape = ["batch", channels, SIZE, SIZE]
    if kind == "nhwc_dynamic":
        shape = ["batch", "height", "width", "channels"]
        nodes.append(helper.make_node("Transpose", [INPUT], ["nchw"], perm=[0, 3, 1, 2]))
        x = "nchw"
    nodes += [helper.make_node("GlobalAveragePool", [x], ["pooled"]),
              helper.make_node("Flatten", ["pooled"], ["flat"])]
    last = "gemm"
    nodes.append(helper.make_node("Gemm", ["flat", "w", "b"],
                                  [OUTPUT if kind in ("logits", "nhwc_dynamic", "gray", "nonfinite_embedding")
                                   else last], transB=1))
    if kind in ("log_softmax", "softmax", "sigmoid"):
        op = {"log_softmax": "LogSoftmax", "softmax": "Softmax", "sigmoid": "Sigmoid"}[kind]
        nodes.append(helper.make_node(op, [last], [OUTPUT], **({} if kind == "sigmoid" else {"axis": -1})))
    if kind in ("nonfinite", "nonfinite_embedding"):
        # 1 / relu(BRIGHT - brightness) + sqrt(BRIGHTER - brightness): infinity, NaN, or below BRIGHT the same finite
        # shift of every logit (the softmax is unchanged)
        inits += [numpy_helper.from_array(np.array(BRIGHT, np.float32), "bright"),
                  numpy_helper.from_array(np.array(BRIGHTER, np.float32), "brighter")]
        nodes += [helper.make_node("ReduceMean", ["flat"], ["brightness"], axes=[1], keepdims=1),
                  helper.make_node("Sub", ["bright", "brightness"], ["margin"]),
                  helper.make_node("Relu", ["margin"], ["clipped"]),
                  helper.make_node("Reciprocal", ["clipped"], ["inf_above"]),
                  helper.make_node("Sub", ["brighter", "brightness"], ["margin2"]),
                  helper.make_node("Sqrt", ["margin2"], ["nan_above"]),
                  helper.make_node("Add", ["inf_above", "nan_above"], ["shift"])]
    outputs = [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", classes])]
    if kind == "nonfinite":
        nodes.append(helper.make_node("Add", [last, "shift"], [OUTPUT]))
    elif kind == "nonfinite_embedding":
        inits.append(numpy_helper.from_array(rng.normal(0, 1, (EMBEDDING_DIM, channels)).astype(np.float32), "we"))
        nodes += [helper.make_node("Gemm", ["flat", "we"], ["projected"], transB=1),
                  helper.make_node("Add", ["projected", "shift"], [EMBEDDING])]
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, shape)],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def model_folder(folder: Path, kind: str = "logits", *, seed: int = 1, classes: int = CLASSES,
                 spec: dict | None = None, labels: str | None = None, external: bool = False) -> Path:
    """A model folder of ``network(kind)``; ``external``: its weights in EXTERNAL_DATA beside it, as
    ``onnx.save_model(..., save_as_external_data=True)`` and torch's exporter past 2 GB write them."""
    import onnx

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = network(kind, seed=seed, classes=classes)
    if external:
        onnx.save_model(model, str(folder / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=EXTERNAL_DATA, size_threshold=0)
    else:
        onnx.save(model, str(folder / MODEL_FILE))
    (folder / LABELS_FILE).write_text(labels if labels is not None else
                                      "".join(f"product_{i}\n" for i in range(classes)), encoding="utf-8")
    if spec is None:
        spec = EMBEDDING_SPEC if kind == "nonfinite_embedding" else SPEC
    (folder / SPEC_FILE).write_text(json.dumps(spec), encoding="utf-8")
    return folder


def bright_images() -> dict[str, bytes]:
    """BRIGHT_IMAGES as PNG bytes, by name."""
    import io

    from PIL import Image

    out = {}
    for name, level in BRIGHT_IMAGES.items():
        buffer = io.BytesIO()
        Image.new("RGB", (96, 72), (level,) * 3).save(buffer, format="PNG")
        out[name] = buffer.getvalue()
    return out
