"""GPU benchmark (one H200 call): model-only ceiling, DALI alone, gpu engine in process and through a local Triton.

Run on a GPU machine with torch, torchvision (ResNet-50), nvidia-dali and tritonclient installed::

    python tests/benchmarks/bench_gpu.py --out results/

It builds its JPEG set from the repository's real photos (tests/data/photos: scikit-image's bundled photos):
random crops (35-100% of the area, 4:3 or 3:4), resized to 500x375 / 375x500 with Lanczos, random mirror and
brightness, JPEG quality 90-96 with 4:2:0 chroma: ImageNet-like files of about 100 KB. It then prints, for
ResNet-50 FP16 (torchvision, random weights) and the default model (EfficientNet-Lite0):

- model only (ceiling): the network on a ready batch, CUDA graph, FP16 channels-last;
- DALI alone: the gpu profile's DALI graph (mixed decode, resize, crop, normalize to FP16 NHWC on the GPU) at
  hardware-decoder loads 0.65 / 0.9 / 1.0, one or two pipelines;
- gpu engine in process: the classifier (DALI) in each ``ENGINE_VARIANTS`` setting;
- gpu engine through Triton: the ``gpu`` profile in tritonserver, client = ``TritonEngine`` (gRPC, padded
  UINT8 + LENGTH, concurrent requests, like the Ray actor), with the average batch Triton formed
  (nv_inference_count / nv_inference_exec_count);

with ratios to the ceiling, stage times, GPU-vs-CPU parity of the default model (top-1
agreement with the ONNX Runtime CPU reference on 520 photo-derived JPEGs of varied sizes, FP16 and FP32 networks),
and tests/support/oddities.py through the GPU path against the onnx engine (statuses and error kinds).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS.parents[1]), str(BENCHMARKS.parent)]  # the repository (pipeline) and tests/ (support)

from gpu_dali import dali_only, overlap_probe  # noqa: E402
from gpu_parity import oddities_part, parity  # noqa: E402
from gpu_timing import IMAGENET_SPEC, engine_rate, model_only, networks  # noqa: E402
from gpu_triton import triton_part  # noqa: E402
from image_sets import make_set  # noqa: E402
from sizing_curves import write_curves  # noqa: E402

LOG = logging.getLogger("bench_gpu")
# In-process engine variants measured on each set.
ENGINE_VARIANTS = {
    "dali": {"prep_workers": 2},
    "dali_3workers": {"prep_workers": 3},
    "dali_h1": {"prep_workers": 2, "hw_decoder_load": 1.0},
    "dali_h1_3workers": {"prep_workers": 3, "hw_decoder_load": 1.0},
    "dali_fp32": {"prep_workers": 2, "half": False},
    # One pipeline with 2 / 3 batches scheduled at once (dali_depth), DALI threads 4 or 8.
    "dali_d2": {"dali_depth": 2},
    "dali_d3": {"dali_depth": 3},
    "dali_h1_d2": {"dali_depth": 2, "hw_decoder_load": 1.0},
    "dali_h1_d3": {"dali_depth": 3, "hw_decoder_load": 1.0},
    "dali_h1_d3_block": {"dali_depth": 3, "hw_decoder_load": 1.0, "cuda_sync": "block"},
    "dali_d2_t8": {"dali_depth": 2, "dali_threads": 8},
    "dali_h1_d3_t8": {"dali_depth": 3, "hw_decoder_load": 1.0, "dali_threads": 8},
}


def _client_pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in pair.split("x")) for pair in text.split(",")]  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_gpu_out"))
    p.add_argument("--images", type=int, default=2048, help="unique JPEGs in the benchmark set")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per measurement")
    p.add_argument("--servers", type=lambda t: t.split(","), default=["1"],
                   help="Triton servers to run one after another: N model instances each (one request stream, "
                        "classifier and CUDA context per instance), N:mps under a private CUDA MPS daemon, "
                        ":block / :spin how the model's threads wait for the GPU; e.g. 3,3:mps,4:mps:block")
    p.add_argument("--prep-workers", type=int, default=2, help="preparing threads per Triton instance")
    p.add_argument("--network-instances", type=int, default=1, help="network model instances of an :ens server")
    p.add_argument("--triton-max-batch", type=int, default=1024)
    p.add_argument("--triton-batch", type=int, default=None, help="network batch inside the Triton model (the "
                   "profile's: 128)")
    p.add_argument("--queue-delay-us", type=int, default=100)
    p.add_argument("--triton-images", type=int, default=16384,
                   help="images per client classify() call (with 8,192 a timed window held one call per client, "
                        "its ramp and drain included)")
    p.add_argument("--client", type=_client_pairs, default=_client_pairs("128x16"),
                   help="request_batch x concurrency pairs, comma-separated")
    p.add_argument("--triton-nets", default="resnet50,default,hop", help="models served in the triton part")
    p.add_argument("--client-procs", type=lambda t: [int(v) for v in t.split(",")], default=[1, 2],
                   help="client processes sharing the server, e.g. 1,2,3 (each one actor-shaped client)")
    p.add_argument("--parts", default="dali,ceiling,engine,parity,oddities,triton")
    p.add_argument("--engine-variants", default="", help="in-process variants to run (default: all)")
    p.add_argument("--hw-decoder-load", type=float, default=None, help="DALI in Triton (default: the model's)")
    p.add_argument("--dali-depth", type=int, default=None, help="DALI in Triton: batches in flight (model default)")
    p.add_argument("--dali-threads", type=int, default=None, help="DALI in Triton: CPU threads (model default)")
    p.add_argument("--py-spy", action="store_true", help="sample the Triton model's stub with py-spy in each run")
    p.add_argument("--half", default="auto", help="Triton model's network precision: auto, true, false")
    p.add_argument("--sets", default="imagenet,light", help="JPEG sets: imagenet (~100 KB), light (~35 KB)")
    p.add_argument("--ceiling-variants", default="plain",
                   help="the network alone: plain (as served), compile (torch.compile)")
    p.add_argument("--bad-inputs", choices=("before", "after", "between"), default="after",
                   help="when the Triton part sends its request holding bad inputs: before the timed runs, after "
                        "them, or between a first timed run and the same run again")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    import torch

    from pipeline.gpu.classifier import ClassifierOptions, GpuClassifier

    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "batch": args.batch}
    t0 = time.perf_counter()
    sets = {name: make_set(args.images, name, 0) for name in args.sets.split(",")}
    results["sets"] = {
        k: {"images": len(v), "mean_kb": round(sum(map(len, v)) / len(v) / 1024, 1)} for k, v in sets.items()
    }
    results["set_build_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(results), flush=True)

    def save():
        (args.out / "bench_gpu.json").write_text(json.dumps(results, indent=2, default=str))
        write_curves(results, args.out)  # what `bulk-classify size` reads

    def attempt(label, fn):
        """Runs one part; a failure is recorded and the run goes on (one device call must give every number)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            LOG.exception("%s failed", label)
            results.setdefault("failures", {})[label] = f"{type(e).__name__}: {e}"
            save()
            return None

    nets = networks()
    for name, (net, _spec) in nets.items():
        if "ceiling" not in parts:
            continue
        for variant in args.ceiling_variants.split(","):
            # "model_only" is the network as the gpu engine serves it; the others are named by variant.
            key = "model_only" if variant == "plain" else f"model_only_{variant}"
            t = time.perf_counter()
            results.setdefault(name, {})[key] = attempt(
                f"{name} ceiling {variant}", lambda: round(model_only(net, args.batch, args.seconds, variant)))
            print(name, "model only", variant, results[name][key], f"({time.perf_counter() - t:.0f} s)", flush=True)
            save()
    if "overlap" in parts:
        net, _ = nets["resnet50"]
        results["overlap_resnet50"] = attempt(
            "overlap", lambda: overlap_probe(sets["imagenet"], IMAGENET_SPEC, net, args.batch, args.seconds))
        save()
    for set_name, bench_set in sets.items():
        if "dali" in parts:
            results[f"dali_only_{set_name}"] = attempt(
                "dali", lambda: dali_only(bench_set, IMAGENET_SPEC, args.batch, args.seconds / 2))
        for name, (net, spec) in nets.items():
            row = results.setdefault(name, {}).setdefault(set_name, {})
            save()
            if "engine" not in parts:
                continue
            for label, options in ENGINE_VARIANTS.items():
                if args.engine_variants and label not in args.engine_variants.split(","):
                    continue
                try:
                    clf = GpuClassifier(net, spec, ClassifierOptions(top_k=5, batch_size=args.batch, **options))
                except Exception as e:  # noqa: BLE001 - report and continue
                    row[f"engine_{label}"] = f"unavailable: {e}"
                    continue
                got = attempt(f"{name} engine {label}", lambda: engine_rate(clf, bench_set * 4, args.seconds))
                if got:
                    row[f"engine_{label}"] = round(got[0])
                    row[f"engine_{label}_stage_ms_per_batch"] = got[1]
                print(name, set_name, label, row.get(f"engine_{label}"), row.get(f"engine_{label}_stage_ms_per_batch"),
                      flush=True)
                clf.close()
            save()
    if "parity" in parts:
        net, spec = nets["default"]
        deep = {"dali_depth": args.dali_depth} if args.dali_depth else {}
        clf = GpuClassifier(net, spec, ClassifierOptions(top_k=5, batch_size=args.batch, half=True, **deep))
        clf32 = GpuClassifier(net, spec, ClassifierOptions(top_k=5, batch_size=args.batch, half=False, **deep))
        attempt("parity", lambda: parity(results, clf, clf32))
        for key in ("parity", "parity_fp32_network"):
            print(key, {k: v for k, v in results.get(key, {}).items() if k != "disagreements"}, flush=True)
        clf.close()
        clf32.close()
        save()
    if "oddities" in parts:
        net, spec = nets["default"]
        attempt("oddities", lambda: oddities_part(results, net, spec))
        print("oddities", results.get("oddities", {}).get("same_status_and_kind"), flush=True)
        save()
    torch.cuda.empty_cache()
    if "triton" in parts:
        attempt("triton", lambda: triton_part(args, results, sets))
    save()
    print_table(results)


def print_table(results: dict) -> None:
    print()
    print(f"device: {results.get('device')}  sets: {results.get('sets')}  batch {results.get('batch')}")
    for key in results:
        if key.startswith("dali_only_"):
            print(f"{key} (img/s): {results[key]}")
    header = f"{'network':<9} {'set':<9} {'path':<58} {'img/s':>8} {'x engine':>8} {'% ceiling':>10}"
    print(header)
    print("-" * len(header))
    for net in ("resnet50", "default", "hop"):
        ceiling = results.get(net, {}).get("model_only")
        for set_name in results.get("sets", {}):
            row = results.get(net, {}).get(set_name, {})
            # "x engine": against the first engine-in-process variant of this run (the issue's "through Triton vs
            # the same engine in process").
            base = next((v for k, v in row.items() if k.startswith("engine_") and not k.endswith("per_batch")
                         and isinstance(v, (int, float))), None)
            lines = [("model only (ceiling: as served)", ceiling)]
            lines += [(f"model only ({k[11:]})", v) for k, v in results.get(net, {}).items()
                      if k.startswith("model_only_")]
            lines += [(f"engine in process ({k[7:]})", v) for k, v in row.items()
                      if k.startswith("engine_") and not k.endswith("per_batch")]
            for key, val in results.items():
                if key.startswith(f"triton_{net}_{set_name}_"):
                    label = key.split(f"{set_name}_", 1)[1]
                    lines.append((f"triton {label} (cores {val.get('client_cores')}/{val.get('server_cores')}"
                                  f", GPU {val.get('gpu_util_mean')} %)", val["img_s"]))
            for label, v in lines:
                if not isinstance(v, (int, float)):
                    print(f"{net:<9} {set_name:<9} {label:<58} {str(v)[:30]:>8}")
                    continue
                xb = f"{v / base:.2f}" if base else "-"
                pc = f"{100 * v / ceiling:.1f}%" if ceiling else "-"
                print(f"{net:<9} {set_name:<9} {label:<58} {v:>8,.0f} {xb:>8} {pc:>10}")
    for net in ("resnet50", "default"):
        for set_name in results.get("sets", {}):
            row = results.get(net, {}).get(set_name, {})
            for key in sorted(row):
                if key.endswith("stage_ms_per_batch"):
                    print(f"{net} {set_name} {key}: {row[key]}")
    for key in ("parity", "parity_fp32_network"):
        if key in results:
            print(key, {k: v for k, v in results[key].items() if k != "disagreements"})
    if "failures" in results:
        print("failures:", results["failures"])


if __name__ == "__main__":
    main()
