"""Timing on the GPU: img/s of a callable, the two networks measured (ResNet-50 and the default model), the network
alone as a CUDA graph (the ceiling) and the in-process classifier with its stage times."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.model.default_model import DEFAULT_SPEC
from pipeline.model.imaging import PreprocessSpec

IMAGENET_SPEC = PreprocessSpec(
    resize_shorter=256,
    interpolation="bilinear",
    crop=(224, 224),
    mean=(123.675, 116.28, 103.53),
    std=(58.395, 57.12, 57.375),
)


def _sync():
    try:
        import torch
    except ImportError:  # a client-only run (no torch here)
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rate(fn, images_per_call: int, min_s: float, warmup: int = 1) -> float:
    """img/s of ``fn`` (which processes ``images_per_call`` images and leaves the GPU idle when it returns)."""
    for _ in range(warmup):
        fn()
    _sync()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        _sync()
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return calls * images_per_call / dt


def networks():
    from pipeline.model.default_model import load_checkpoint
    from gpu_networks import resnet50_random

    from pipeline.gpu.networks import efficientnet_lite0

    return {
        "resnet50": (resnet50_random(), IMAGENET_SPEC),
        "default": (efficientnet_lite0(load_checkpoint()), DEFAULT_SPEC),
    }


def model_only(net, batch: int, min_s: float, variant: str = "plain") -> float:
    """The ceiling: the network alone on a ready FP16 channels-last batch, replayed as a CUDA graph.

    ``variant``: "plain" (as the gpu engine serves it) or "compile" (``torch.compile``d, in the same CUDA graph; it
    had not finished compiling ResNet-50 after 110 s on the H200).
    """
    import copy

    import torch

    net = copy.deepcopy(net).cuda().half().to(memory_format=torch.channels_last).eval()
    if variant == "compile":
        net = torch.compile(net, mode="max-autotune-no-cudagraphs", dynamic=False)
    x = torch.randn(batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                net(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = net(x)

        def step():
            for _ in range(10):
                g.replay()

        r = rate(step, 10 * batch, min_s)
    del y
    return r


@dataclass
class StageTimes:
    """Wall seconds spent per stage (preparation, DALI and the reference, overlaps the network)."""

    images: int = 0
    prepare_s: float = 0.0
    network_s: float = 0.0
    total_s: float = 0.0


def timed(clf) -> StageTimes:
    """Times ``clf``'s stages from now on: each ``classify`` call, each batch's network launch and its preparation
    (``Chunk.prepare_s``, counted as the stream hands the batch to the network)."""
    t = StageTimes()
    classify, infer = clf._classify, clf._infer

    def timed_classify(images):
        t0 = time.perf_counter()
        out = classify(images)
        t.images += len(images)
        t.total_s += time.perf_counter() - t0
        return out

    def timed_infer(chunk):
        t0 = time.perf_counter()
        out = infer(chunk)
        t.network_s += time.perf_counter() - t0
        t.prepare_s += chunk.prepare_s
        return out

    clf._classify, clf._infer = timed_classify, timed_infer
    return t


def engine_rate(clf, images: list[bytes], min_s: float) -> tuple[float, dict]:
    clf.classify(images[: clf.batch_size * 2])  # warm-up: graphs, cudnn plans, decoder buffers
    t = timed(clf)
    r = rate(lambda: clf.classify(images), len(images), min_s, warmup=0)
    calls = max(1, t.images / clf.batch_size)
    per_batch = {
        "prepare_ms": round(t.prepare_s / calls * 1e3, 2),
        "net_launch_ms": round(t.network_s / calls * 1e3, 2),
        "wall_ms": round(t.total_s / calls * 1e3, 2),
    }
    return r, per_batch
