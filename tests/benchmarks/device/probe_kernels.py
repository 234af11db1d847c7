"""Where the GPU's time goes, kernel by kernel: the default network alone against timm's, and the served classifier.

    python tests/benchmarks/device/probe_kernels.py [--batch 256] [--seconds 4] [--top 14] [--images 2048]

1. The network alone (``TopKNetwork``: FP16, channels-last, CUDA graph, softmax + top-5), each of ``--layouts`` and
   timm's ``efficientnet_lite0`` (random weights), each on a ready batch: img/s, then ``torch.profiler`` over a few
   replays: GPU microseconds per batch by kernel, the kernels' sum against the wall time per batch.
2. The gpu profile's classifier as a Triton instance builds it (``gpu_model.build_classifier`` with the config's
   defaults) classifying the imagenet set in process: img/s, then the kernels of a profiled window by owner (DALI's
   decode and preprocessing, or the network) in microseconds per image. The hardware JPEG decoder's work is not a
   kernel: it shows as the gap between the wall time and the kernels' sum.

Kernels launched inside a CUDA graph are traced like any other (CUPTI), so the graph's replays count.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "benchmarks")]

DALI_MARKS = ("dali", "nvjpeg", "nvimgcodec", "resample", "Resample", "crop", "Crop", "Normalize", "ColorSpace",
              "color", "jpeg", "Jpeg", "Decode", "decode", "Huffman", "idct", "IDCT", "Slice", "Transpose")


def kernel_times(prof) -> collections.Counter:
    """GPU microseconds by kernel name over a profiled window."""
    out: collections.Counter = collections.Counter()
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            out[ev.name] += ev.time_range.elapsed_us()
    return out


def profiled(torch, step, repeats: int):
    """(kernel times, wall seconds) of ``repeats`` steps under torch.profiler (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return kernel_times(prof), wall


def print_kernels(title: str, times: collections.Counter, per: float, unit: str, wall_per: float, top: int) -> None:
    total = sum(times.values())
    print(f"\n{title}: kernels {total / per:.1f} us per {unit}, wall {wall_per * 1e6:.1f} us per {unit} "
          f"(kernels / wall {total / per / (wall_per * 1e6):.2f}), {len(times)} kernel names")
    for name, us in times.most_common(top):
        print(f"  {us / per:9.2f} us  {100 * us / max(total, 1):5.1f} %  {name[:110]}")


def network_part(torch, args) -> None:
    from bench_network import throughput

    from pipeline.model.default_model import load_checkpoint
    from lite0_layouts import layout_network

    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    weights = load_checkpoint()
    nets = [(f"layout {name}", lambda name=name: layout_network(weights, name))
            for name in args.layouts.split(",")]
    try:
        import timm

        nets.append(("timm efficientnet_lite0", lambda: timm.create_model("efficientnet_lite0", pretrained=False).eval()))
    except ImportError:
        print("timm is not installed: the default layout alone")
    for name, make in nets:
        img_s, tk = throughput(torch, make(), device, batch=args.batch, half=True, seconds=args.seconds, replays=10)
        x = torch.randn(args.batch, 3, *tk.crop, device=device).to(tk.dtype).contiguous(memory_format=torch.channels_last)
        times, wall = profiled(torch, lambda: tk.scores(x), 20)
        print(f"\n== {name}: {img_s:,.0f} img/s at batch {args.batch}")
        print_kernels(name, times, 20, "batch", wall / 20, args.top)
        # the same network without the graph's input copy, the flip and the top-k: the module alone
        mod_times, mod_wall = profiled(torch, lambda: tk.run(x), 20)
        print(f"  run() alone (logits, no softmax/top-k): wall {mod_wall / 20 * 1e6:.0f} us per batch, "
              f"{args.batch * 20 / mod_wall:,.0f} img/s")


def classifier_part(torch, args) -> None:
    from image_sets import make_set

    from pipeline.model.default_model import DEFAULT_SPEC
    from pipeline.gpu.networks import load_network
    from pipeline.model.imaging import DecodeLimits
    from pipeline.model.folder import load_model
    from pipeline.triton.serve.gpu_model import build_classifier

    blobs = make_set(args.images, "imagenet", 0)
    print(f"\n== the served classifier (gpu_model.build_classifier defaults) on {len(blobs)} imagenet JPEGs, "
          f"mean {sum(map(len, blobs)) / len(blobs) / 1024:.1f} KB")
    bundle = load_model(None)
    clf = build_classifier({"parameters": {}}, DEFAULT_SPEC, load_network(bundle), device="cuda:0", top_k=5,
                           limits=DecodeLimits(), batch_size=args.batch)
    clf.warmup()
    clf.classify(blobs)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        clf.classify(blobs)
        n += len(blobs)
    rate = n / (time.perf_counter() - t0)
    print(f"classify(): {rate:,.0f} img/s over {n} images (one classifier, in process)")
    times, wall = profiled(torch, lambda: clf.classify(blobs), 2)
    images = 2 * len(blobs)
    owners: collections.Counter = collections.Counter()
    for name, us in times.items():
        owners["DALI (decode, preprocess)" if any(m in name for m in DALI_MARKS) else "network and the rest"] += us
    print_kernels("served classifier", times, images, "image", wall / images, args.top)
    for owner, us in owners.most_common():
        print(f"  owner {owner:<28} {us / images:7.2f} us per image")
    clf.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--parts", default="network,classifier")
    p.add_argument("--layouts", default="mirror,mirror_gemm", help="LITE0_LAYOUTS names for the network part")
    args = p.parse_args()
    import torch

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    if "network" in args.parts:
        network_part(torch, args)
    if "classifier" in args.parts:
        classifier_part(torch, args)


if __name__ == "__main__":
    main()
