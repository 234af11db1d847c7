"""DALI parity on the CPU: the shared DALI graph against the reference preprocessing, before and after, in one run.

The graph is ``pipeline.gpu.dali_graph.preprocess_graph`` (the one definition behind the production ensemble's
DALI model and the gpu engine's ``GpuClassifier``), built with DALI's CPU backend; the reference is
``pipeline.model.imaging`` (Pillow). DALI's CPU decoder is libjpeg-turbo like Pillow's (the "decode" row checks that they
give the same pixels), so on the CPU every difference left is resize, crop and normalize. The set is image_sets.py's
520-image parity set (``make_set(520, "varied", 10_000)``: JPEGs of 160-1,100 px cut from tests/data/photos, 30%
portrait, 10% gray, about a third of them upscaled to 256).

Rows (pixel levels 0..255 before normalisation; top-1 with the default model's ONNX network in ONNX Runtime on
both sides):

- before: one ``fn.resize`` over the region of interest (float intermediate, DALI's own pass order) against one
  ``Image.resize`` call (Pillow 13 picks its own pass order too);
- after: ``preprocess_graph`` against ``pipeline.model.imaging`` (both: horizontal pass, rounded to 8 bits, vertical pass);
- reference before vs after: how far the reference itself moved.

With ``--time-s S`` it also times both graphs on DALI's CPU backend over the same files (img/s and their ratio, same
run): the two-pass graph resamples every row of the decoded image in its first pass. Timed runs hold the shared
benchmark lock: ``flock /tmp/bench.lock python tests/benchmarks/bench_dali_parity.py --time-s 10``.

``--device mixed`` runs the same comparison with DALI's GPU decoder (nvJPEG and the hardware engines) on GPU 0: the
resize is then DALI's CUDA kernel, the network still ONNX Runtime on the CPU, so only the preprocessing differs.

Usage::

    python tests/benchmarks/bench_dali_parity.py [--count 520] [--out DIR] [--time-s S] [--device mixed --onnx FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from image_sets import make_set  # noqa: E402

from pipeline.model.default_model import DEFAULT_SPEC  # noqa: E402
from pipeline.model.imaging import PreprocessSpec, decode_image, normalize_array, preprocess_image  # noqa: E402
from pipeline.model.folder import load_model  # noqa: E402
from pipeline.gpu.dali_graph import _INTERP, preprocess_graph  # noqa: E402

LOG = logging.getLogger("bench_dali_parity")
BATCH = 32


def legacy_graph(encoded, spec: PreprocessSpec, device: str = "cpu"):
    """preprocess_graph before the fix: one fn.resize over the source region of interest."""
    import nvidia.dali.fn as fn
    import nvidia.dali.math as dmath
    import nvidia.dali.types as types

    extra = {"jpeg_fancy_upsampling": True} if device == "mixed" else {}
    image = fn.decoders.image(encoded, device=device, output_type=types.RGB, adjust_orientation=True, **extra)
    shape = image.shape(dtype=types.FLOAT)
    height, width = shape[0], shape[1]
    crop_h, crop_w = spec.crop
    shorter = dmath.min(height, width)
    box_h, box_w = crop_h * shorter / float(spec.resize_shorter), crop_w * shorter / float(spec.resize_shorter)
    top, left = (height - box_h) / 2.0, (width - box_w) / 2.0
    resized = fn.resize(image, size=[crop_h, crop_w], roi_start=fn.stack(top, left),
                        roi_end=fn.stack(top + box_h, left + box_w), roi_relative=False,
                        interp_type=getattr(types, _INTERP[spec.interpolation]), antialias=spec.antialias,
                        dtype=types.UINT8)
    return fn.crop_mirror_normalize(resized, mean=[m / spec.scale for m in spec.mean],
                                    std=[s / spec.scale for s in spec.std], output_layout="CHW", dtype=types.FLOAT)


def legacy_reference(data: bytes, spec: PreprocessSpec) -> np.ndarray:
    """pipeline.model.imaging before the fix: one Image.resize call (the pass order is the installed Pillow's)."""
    return legacy_reference_image(decode_image(data), spec)


def legacy_reference_image(img, spec: PreprocessSpec) -> np.ndarray:
    """preprocess_image before the fix, on a decoded image."""
    from pipeline.model.imaging import _PIL_FILTERS

    crop_h, crop_w = spec.crop
    w, h = img.size
    factor = spec.resize_shorter / min(w, h)
    box_w, box_h = crop_w / factor, crop_h / factor
    left, top = (w - box_w) / 2.0, (h - box_h) / 2.0
    out = img.resize((crop_w, crop_h), _PIL_FILTERS[spec.interpolation], box=(left, top, left + box_w, top + box_h))
    return normalize_array(np.asarray(out), spec)


def _pipeline(graph, device: str):
    """A built DALI pipeline of ``graph(encoded) -> one output``; CPU backend, or "mixed" on GPU 0."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    # The graph's sizes go GPU -> CPU with the mixed decoder, which only the async pipelined executor allows.
    mixed = device == "mixed"

    @pipeline_def(batch_size=BATCH, num_threads=2, device_id=0 if mixed else None, prefetch_queue_depth=1,
                  exec_async=mixed, exec_pipelined=mixed)
    def pipe():
        return graph(fn.external_source(name="encoded", dtype=types.UINT8, ndim=1))

    p = pipe()
    p.build()
    return p


def run_dali(graph, blobs: list[bytes], device: str = "cpu") -> list[np.ndarray]:
    """Runs ``graph(encoded) -> one output`` over ``blobs`` on ``device``; one host array per file."""
    p = _pipeline(graph, device)
    out = []
    for start in range(0, len(blobs), BATCH):
        chunk = blobs[start : start + BATCH]
        p.feed_input("encoded", [np.frombuffer(b, dtype=np.uint8) for b in chunk])
        (tensors,) = p.run()
        tensors = tensors.as_cpu() if hasattr(tensors, "as_cpu") else tensors
        out.extend(np.array(tensors.at(i)) for i in range(len(chunk)))
    return out


def dali_rate(graph, blobs: list[bytes], seconds: float, device: str = "cpu") -> float:
    """img/s of ``graph`` on ``device`` (2 CPU threads, batches of BATCH, one at a time), fed the files again and
    again; on the GPU each batch's output is copied to the host, so the copy counts."""
    p = _pipeline(graph, device)
    batches = [[np.frombuffer(b, dtype=np.uint8) for b in blobs[i : i + BATCH]]
               for i in range(0, len(blobs) - BATCH + 1, BATCH)]
    p.feed_input("encoded", batches[0])
    p.run()  # warm-up
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for batch in batches:
            p.feed_input("encoded", batch)
            (out,) = p.run()
            if hasattr(out, "as_cpu"):
                out.as_cpu()
            done += len(batch)
    return done / (time.perf_counter() - t0)


def reference_ms(preprocess, images: list, seconds: float) -> float:
    """Milliseconds per image of ``preprocess(decoded image)``, one thread, over the decoded set again and again."""
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for img in images:
            preprocess(img)
        done += len(images)
    return (time.perf_counter() - t0) * 1000 / done


def decoded_differences(blobs: list[bytes], device: str = "cpu") -> tuple[int, int]:
    """(largest level difference, images that differ) between DALI's decoder and the reference's decode."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    extra = {"jpeg_fancy_upsampling": True} if device == "mixed" else {}
    decoded = run_dali(lambda enc: fn.decoders.image(enc, device=device, output_type=types.RGB,
                                                     adjust_orientation=True, **extra), blobs, device)
    worst, differing = 0, 0
    for dali, data in zip(decoded, blobs):
        ref = np.asarray(decode_image(data))
        diff = int(np.abs(dali.astype(np.int16) - ref.astype(np.int16)).max()) if dali.shape == ref.shape else 255
        worst, differing = max(worst, diff), differing + int(diff > 0)
    return worst, differing


def levels(x: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """Normalized NCHW RGB tensors back to their 0..255 levels (exact for 8-bit sources)."""
    mean = np.asarray(spec.mean, dtype=np.float64)[None, :, None, None]
    std = np.asarray(spec.std, dtype=np.float64)[None, :, None, None]
    return np.rint((x.astype(np.float64) * std + mean) / spec.scale).astype(np.int16)


def probabilities(session, input_name: str, x: np.ndarray) -> np.ndarray:
    logits = np.concatenate([session.run(None, {input_name: x[i : i + 64]})[0] for i in range(0, len(x), 64)])
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def compare(name: str, spec: PreprocessSpec, x: np.ndarray, ref: np.ndarray, p_x: np.ndarray, p_ref: np.ndarray) -> dict:
    diff = np.abs(levels(x, spec) - levels(ref, spec)).reshape(len(x), -1)
    top_ref, top_x = p_ref.argmax(1), p_x.argmax(1)
    ranked = np.sort(p_ref, axis=1)
    margins = (ranked[:, -1] - ranked[:, -2])[top_ref != top_x]
    return {
        "row": name,
        "images": len(x),
        "max_levels": int(diff.max()),
        "mean_levels": float(diff.mean()),
        "values_differing_pct": float((diff > 0).mean() * 100),
        "images_over_2_levels": int((diff.max(axis=1) > 2).sum()),
        "top1_agreement_pct": float((top_ref == top_x).mean() * 100),
        "disagreements": int((top_ref != top_x).sum()),
        "margins": [round(float(m), 4) for m in margins],
        "x_top1_is_ref_top2": int(sum(int(np.argsort(p_ref[i])[-2] == top_x[i]) for i in np.nonzero(top_ref != top_x)[0])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=520, help="images of the parity set (image_sets.make_set)")
    p.add_argument("--out", type=Path, default=None, help="folder for results.json")
    p.add_argument("--time-s", type=float, default=0.0, help="also time both graphs this long each (hold the lock)")
    p.add_argument("--device", choices=("cpu", "mixed"), default="cpu",
                   help="DALI's decoder: cpu (libjpeg-turbo) or mixed (nvJPEG / hardware engines, GPU 0)")
    p.add_argument("--onnx", type=Path, default=None,
                   help="the default model's ONNX file (default: built or found by pipeline.model.folder.load_model)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import onnxruntime as ort

    t0 = time.perf_counter()
    spec = DEFAULT_SPEC
    onnx_path = args.onnx or load_model(None).onnx_path
    blobs = make_set(args.count, "varied", 10_000)
    LOG.info("set: %d JPEGs, mean %.1f KB", len(blobs), sum(map(len, blobs)) / len(blobs) / 1024)
    decode_max, decode_differing = decoded_differences(blobs, args.device)

    def graph_after(enc):
        return preprocess_graph(enc, spec, device=args.device, layout="CHW")[0]

    def graph_before(enc):
        return legacy_graph(enc, spec, args.device)

    ref_after = np.stack([preprocess_image(decode_image(b), spec) for b in blobs])
    ref_before = np.stack([legacy_reference(b, spec) for b in blobs])
    dali_after = np.stack(run_dali(graph_after, blobs, args.device))
    dali_before = np.stack(run_dali(graph_before, blobs, args.device))

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    probs = {k: probabilities(session, input_name, v) for k, v in
             (("ref_after", ref_after), ("ref_before", ref_before), ("dali_after", dali_after),
              ("dali_before", dali_before))}
    rows = [
        compare("before: one fn.resize vs one Image.resize", spec, dali_before, ref_before, probs["dali_before"],
                probs["ref_before"]),
        compare("after: preprocess_graph vs pipeline.model.imaging", spec, dali_after, ref_after, probs["dali_after"],
                probs["ref_after"]),
        compare("reference before vs after", spec, ref_before, ref_after, probs["ref_before"], probs["ref_after"]),
        compare("before graph vs reference after", spec, dali_before, ref_after, probs["dali_before"],
                probs["ref_after"]),
    ]
    import PIL
    import nvidia.dali

    print(f"\nDALI {nvidia.dali.__version__} ({args.device}) vs Pillow {PIL.__version__}, {len(blobs)} JPEGs; decode: "
          f"DALI vs Pillow max {decode_max} levels, {decode_differing} images differ\n")
    print("| comparison | images | max levels | mean levels | values differing | images > 2 levels | top-1 agree | "
          "disagreements (other's top-1 = ref's top-2) | ref margins of the disagreements |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['images']} | {r['max_levels']} | {r['mean_levels']:.4f} | "
              f"{r['values_differing_pct']:.2f}% | {r['images_over_2_levels']} | {r['top1_agreement_pct']:.2f}% | "
              f"{r['disagreements']} ({r['x_top1_is_ref_top2']}) | {', '.join(map(str, r['margins'])) or '-'} |")
    before, after = rows[0], rows[1]
    print(f"\nafter / before: mean level difference x{after['mean_levels'] / max(before['mean_levels'], 1e-12):.3f}, "
          f"disagreements {before['disagreements']} -> {after['disagreements']}; {time.perf_counter() - t0:.0f} s")
    timing = {}
    if args.time_s > 0:
        timing = {"dali_img_s_before": dali_rate(graph_before, blobs, args.time_s, args.device),
                  "dali_img_s_after": dali_rate(graph_after, blobs, args.time_s, args.device)}
        decoded = [decode_image(b) for b in blobs]
        timing["reference_ms_before"] = reference_ms(lambda img: legacy_reference_image(img, spec), decoded,
                                                     args.time_s)
        timing["reference_ms_after"] = reference_ms(lambda img: preprocess_image(img, spec), decoded, args.time_s)
        print(f"DALI {args.device} (2 threads, batch {BATCH}): before {timing['dali_img_s_before']:.1f} img/s, after "
              f"{timing['dali_img_s_after']:.1f} img/s, after / before "
              f"{timing['dali_img_s_after'] / timing['dali_img_s_before']:.3f}")
        print(f"reference resize + normalize (1 thread, decoded): before {timing['reference_ms_before']:.2f} ms/img, "
              f"after {timing['reference_ms_after']:.2f} ms/img, after / before "
              f"{timing['reference_ms_after'] / timing['reference_ms_before']:.3f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        results = {"device": args.device, "rows": rows, "decode_max_levels": decode_max,
                   "decode_images_differing": decode_differing, "timing": timing}
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
