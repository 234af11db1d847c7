"""Where a user's model's GPU answers part from ONNX Runtime's on the CPU: decoding, resizing or precision.

    python tests/benchmarks/device/probe_parity.py MODEL_DIR [IMAGES_DIR]   (default tests/data/parity/inputs)

The reference is ONNX Runtime FP32 on the CPU over the reference preprocessing (``pipeline.model.imaging``, Pillow). Each
JPEG is preprocessed four ways: the reference, and DALI with the hardware JPEG decoders (the GPU paths' default),
with CUDA nvJPEG (``hw_decoder_load=0``) and on the CPU (libjpeg-turbo). Each tensor set is given to the model's
converted network on the GPU in FP32 (TF32 off), FP32 with TF32 and FP16, and to ONNX Runtime (the tensors' effect
alone). Printed per cell: top-1 agreement with the reference and each disagreement's reference margin (p1 - p2);
per DALI variant, the largest and mean difference from the reference's tensor in input levels.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))


def main() -> None:
    import numpy as np
    import onnxruntime as ort
    import torch

    from pipeline.gpu.dali import DaliPrep, host_array
    from pipeline.gpu.onnx_torch import convert_checked
    from pipeline.model.imaging import DecodeLimits, load_and_preprocess
    from pipeline.model.folder import load_model_folder

    folder = Path(sys.argv[1])
    images = Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / "tests/data/parity/inputs"
    bundle = load_model_folder(folder)
    spec = bundle.spec
    files = sorted(p for p in images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    blobs = [p.read_bytes() for p in files]
    limits = DecodeLimits()
    ref = np.stack([load_and_preprocess(b, spec, limits)[0] for b in blobs]).astype(np.float32)  # NCHW

    tensors = {"reference": ref}
    for name, kw in (("dali hw", dict(device="mixed", device_id=0, hw_decoder_load=1.0)),
                     ("dali cuda", dict(device="mixed", device_id=0, hw_decoder_load=0.0)),
                     ("dali cpu", dict(device="cpu"))):
        prep = DaliPrep(spec, batch_size=len(blobs), layout="CHW", half=False, **kw)
        with prep.batch(blobs) as out:
            tensors[name] = host_array(out).astype(np.float32)
        prep.close()
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, 3, 1, 1) / float(spec.scale)
    print(f"{len(files)} JPEGs from {images}, model {folder} ({bundle.short_digest})")
    print("| tensors | max diff (levels) | mean diff (levels) | pixels > 1 level |")
    print("|---|---|---|---|")
    for name, t in tensors.items():
        d = np.abs((t - ref) * std)
        print(f"| {name} | {d.max():.2f} | {d.mean():.4f} | {(d > 1.0).mean():.2%} |")

    sess = ort.InferenceSession(str(bundle.onnx_path), providers=["CPUExecutionProvider"])
    iname = bundle.input_name

    def softmax(z):
        z = z - z.max(1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(1, keepdims=True)

    def probs_of(logits):
        return logits if spec.output == "probabilities" else softmax(logits)

    def ort_run(x):
        return np.concatenate([sess.run(None, {iname: x[i:i + 16]})[0] for i in range(0, len(x), 16)])

    ref_p = probs_of(ort_run(ref).astype(np.float64))
    order = np.argsort(-ref_p, 1)
    ref_top1 = order[:, 0]
    margin = ref_p[np.arange(len(ref_p)), order[:, 0]] - ref_p[np.arange(len(ref_p)), order[:, 1]]
    print(f"reference near-ties (margin < 0.01): {int((margin < 0.01).sum())}; smallest margins "
          f"{', '.join(f'{m:.4f}' for m in np.sort(margin)[:5])}")

    net = convert_checked(bundle.onnx_path, bundle.spec).network.to("cuda").eval()

    def gpu_run(x, dtype, tf32):
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        out = []
        with torch.inference_mode():
            m = net.to(dtype)
            for i in range(0, len(x), 64):
                out.append(m(torch.from_numpy(x[i:i + 64]).to("cuda", dtype)).float().cpu().numpy())
        net.float()
        return np.concatenate(out)

    runs = {"onnxruntime cpu fp32": lambda x: ort_run(x),
            "gpu fp32 (tf32 off)": lambda x: gpu_run(x, torch.float32, False),
            "gpu fp32 (tf32)": lambda x: gpu_run(x, torch.float32, True),
            "gpu fp16": lambda x: gpu_run(x, torch.float16, False)}
    print("| tensors | network | top-1 agree | disagreements: reference margin |")
    print("|---|---|---|---|")
    for tname, t in tensors.items():
        for rname, run in runs.items():
            if tname == "reference" and rname.startswith("onnxruntime"):
                continue
            top1 = probs_of(run(t).astype(np.float64)).argmax(1)
            bad = np.flatnonzero(top1 != ref_top1)
            print(f"| {tname} | {rname} | {len(files) - len(bad)}/{len(files)} | "
                  f"{', '.join(f'{files[i].name} {margin[i]:.4f}' for i in bad) or '-'} |")


if __name__ == "__main__":
    main()
