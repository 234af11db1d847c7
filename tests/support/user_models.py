"""A small user model made in the test: a torch CNN exported to ONNX as a user would, in a model folder."""

from __future__ import annotations

import json

import torch

from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE

CLASSES = 5
# Small input, so that FP16 on the CPU (the gate) stays quick.
SPEC = {"resize_shorter": 72, "crop": [64, 64], "mean": [123.7, 116.3, 103.5], "std": [58.4, 57.1, 57.4]}


class TinyNet(torch.nn.Module):
    """Conv, BatchNorm, pooling and a flatten whose shape is computed from the input (Shape/Gather/Concat/Reshape in
    ONNX, as real exports have), then a classifier; ``scale`` multiplies the logits (huge: overflows FP16)."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2))
        self.fc = torch.nn.Linear(32 * 4, CLASSES)
        self.scale = scale

    def forward(self, x):
        x = self.features(x)
        return self.fc(x.reshape(x.shape[0], -1)) * self.scale


# A model's embedding: EmbedNet's second graph output, or (``model_folder(..., embedding=True)``) TinyNet's flattened
# features, the intermediate tensor before its classifier; EMBEDDING_DIM wide either way.
EMBEDDING = "features"
EMBEDDING_DIM = 32 * 4


def embedding_spec(output: str = EMBEDDING, normalize: bool = True) -> dict:
    """``SPEC`` declaring the embedding ``output``."""
    return {**SPEC, "embedding": {"output": output, "dim": EMBEDDING_DIM, "normalize": normalize}}


class EmbedNet(TinyNet):
    """TinyNet returning (logits, its flattened features): a model with an embedding as a second graph output."""

    def forward(self, x):
        x = self.features(x)
        flat = x.reshape(x.shape[0], -1)
        return self.fc(flat) * self.scale, flat


class TokenNet(torch.nn.Module):
    """A transformer-shaped network: patches, a class token expanded to the batch (Expand of a computed shape in
    ONNX, as ViTs export), a position term, attention over the tokens, the class token's logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.patches = torch.nn.Conv2d(3, 16, 16, stride=16)
        self.token = torch.nn.Parameter(torch.randn(1, 1, 16))
        self.position = torch.nn.Parameter(torch.randn(1, 1, 16))
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, CLASSES)

    def forward(self, x):
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.token.expand(x.shape[0], -1, -1), tokens], dim=1)
        tokens = tokens + self.position.repeat(1, tokens.shape[1], 1)
        out, _ = self.attention(tokens, tokens, tokens)
        return self.head(out[:, 0])


def model_folder(path, net: torch.nn.Module | None = None, *, fixed_batch: int | None = None,
                 embedding: bool = False):
    """``fixed_batch``: export with that batch size as a number (no dynamic batch axis), as some exports come. An
    ``EmbedNet`` is exported with its features as the graph's second output, declared in its spec; ``embedding``
    declares a TinyNet's flattened features (the Reshape's output, an intermediate tensor) as its embedding."""
    import onnx

    path.mkdir(parents=True)
    outputs = ["logits"] + ([EMBEDDING] if isinstance(net, EmbedNet) else [])
    dynamic = None if fixed_batch else {name: {0: "batch"} for name in ("input", *outputs)}
    torch.onnx.export((net or TinyNet()).eval(), torch.randn(fixed_batch or 2, 3, 64, 64), str(path / MODEL_FILE),
                      input_names=["input"], output_names=outputs, opset_version=17, dynamo=False,
                      dynamic_axes=dynamic)
    spec = SPEC
    if isinstance(net, EmbedNet):
        spec = embedding_spec()
    elif embedding:
        graph = onnx.load(str(path / MODEL_FILE)).graph
        spec = embedding_spec(next(n.output[0] for n in graph.node if n.op_type == "Reshape"))
    (path / LABELS_FILE).write_text("".join(f"class{i}\n" for i in range(CLASSES)))
    (path / SPEC_FILE).write_text(json.dumps(spec))
    return path


def onnx_embeddings(bundle, images):
    """ONNX Runtime on the reference preprocessing (Pillow + numpy) of each encoded image: (class outputs [N, classes],
    embeddings [N, dim] per the spec), the graph's embedding tensor fetched as an output."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from pipeline.gpu.onnx_torch import with_outputs
    from pipeline.model.imaging import load_and_preprocess
    from pipeline.model.scores import embeddings_of

    graph = with_outputs(onnx.load(str(bundle.onnx_path)), [bundle.output_name, bundle.spec.embedding.output])
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    batch = np.stack([load_and_preprocess(data, bundle.spec)[0] for data in images]).astype(np.float32)
    logits, features = session.run(None, {bundle.input_name: batch})
    return logits, embeddings_of(features, bundle.spec.embedding)


def cosine(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
