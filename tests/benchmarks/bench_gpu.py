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
import io
import itertools
import json
import logging
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.default_model import DEFAULT_SPEC  # noqa: E402
from pipeline.imaging import PreprocessSpec  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.triton.configs import check_gpu_decoder  # noqa: E402

PHOTOS = REPO / "tests" / "data" / "photos"
IMAGENET_SPEC = PreprocessSpec(
    resize_shorter=256,
    interpolation="bilinear",
    crop=(224, 224),
    mean=(123.675, 116.28, 103.53),
    std=(58.395, 57.12, 57.375),
)
LOG = logging.getLogger("bench_gpu")
# In-process engine variants measured on each set.
ENGINE_VARIANTS = {
    "dali": {"decoder": "dali", "prep_workers": 2},
    "dali_3workers": {"decoder": "dali", "prep_workers": 3},
    "dali_h1": {"decoder": "dali", "prep_workers": 2, "hw_decode_load": 1.0},
    "dali_h1_3workers": {"decoder": "dali", "prep_workers": 3, "hw_decode_load": 1.0},
    "dali_fp32": {"decoder": "dali", "prep_workers": 2, "half": False},
    # One pipeline with 2 / 3 batches scheduled at once (dali_depth), DALI threads 4 or 8.
    "dali_d2": {"decoder": "dali", "dali_depth": 2},
    "dali_d3": {"decoder": "dali", "dali_depth": 3},
    "dali_h1_d2": {"decoder": "dali", "dali_depth": 2, "hw_decode_load": 1.0},
    "dali_h1_d3": {"decoder": "dali", "dali_depth": 3, "hw_decode_load": 1.0},
    "dali_h1_d3_block": {"decoder": "dali", "dali_depth": 3, "hw_decode_load": 1.0, "cuda_sync": "block"},
    "dali_d2_t8": {"decoder": "dali", "dali_depth": 2, "dali_threads": 8},
    "dali_h1_d3_t8": {"decoder": "dali", "dali_depth": 3, "hw_decode_load": 1.0, "dali_threads": 8},
}
DALI_LOADS = (0.65, 0.9, 1.0)  # the hardware JPEG engines' share of each batch (the issue's three)
NOISE_SIGMA = 5.0
QUALITY = (94, 98)


# ---- data -------------------------------------------------------------------------------------------------


def _photos() -> list:
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]


def _make_one(args) -> bytes:
    """One deterministic JPEG: crop, resize, mirror, brightness and quality drawn from ``seed``."""
    seed, size_mode = args
    from PIL import Image, ImageEnhance

    rng = np.random.default_rng(seed)
    photos = _photos_cache()
    img = photos[seed % len(photos)]
    w, h = img.size
    portrait = rng.random() < 0.3
    aspect = 3 / 4 if portrait else 4 / 3
    area = rng.uniform(0.35, 1.0) * w * h
    cw = min(w, int(round((area * aspect) ** 0.5)))
    ch = min(h, int(round(cw / aspect)))
    cw = min(cw, int(round(ch * aspect)))
    x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    crop = img.crop((x0, y0, x0 + cw, y0 + ch))
    if size_mode in ("imagenet", "light"):
        out_w, out_h = (375, 500) if portrait else (500, 375)
    else:  # parity set: varied sizes, some upscaled, some small
        long_side = int(rng.integers(160, 1100))
        out_w, out_h = (int(long_side * 3 / 4), long_side) if portrait else (long_side, int(long_side * 3 / 4))
    crop = crop.resize((out_w, out_h), Image.Resampling.LANCZOS)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    crop = ImageEnhance.Brightness(crop).enhance(float(rng.uniform(0.8, 1.2)))
    if size_mode == "imagenet":
        # Sensor-like grain: the photos are at most 640 px, so upscaled crops are smoother (and their JPEGs
        # smaller) than camera photos; mild noise brings the files to ImageNet's ~100 KB at 500x375.
        arr = np.asarray(crop, dtype=np.float32)
        arr = arr + rng.normal(0.0, NOISE_SIGMA, arr.shape).astype(np.float32)
        crop = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8))
        quality = int(rng.integers(QUALITY[0], QUALITY[1] + 1))
    elif size_mode == "light":  # the light files of the earlier device notes (~40 KB): quality 85, no grain
        quality = 85
    else:
        quality = int(rng.integers(80, 96))
        if rng.random() < 0.1:
            crop = crop.convert("L")
    buf = io.BytesIO()
    crop.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


_PHOTO_CACHE: list = []


def _photos_cache() -> list:
    if not _PHOTO_CACHE:
        _PHOTO_CACHE.extend(_photos())
    return _PHOTO_CACHE


def make_set(count: int, size_mode: str, seed0: int) -> list[bytes]:
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(_make_one, [(seed0 + i, size_mode) for i in range(count)], chunksize=32))


# ---- helpers ----------------------------------------------------------------------------------------------


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
    from pipeline.default_model import load_checkpoint
    from pipeline.engines.gpu.networks import efficientnet_lite0, resnet50_random

    return {
        "resnet50": (resnet50_random(), IMAGENET_SPEC),
        "default": (efficientnet_lite0(load_checkpoint()), DEFAULT_SPEC),
    }


def model_only(net, batch: int, min_s: float, variant: str = "plain") -> float:
    """The ceiling: the network alone on a ready FP16 channels-last batch, replayed as a CUDA graph.

    ``variant``: "plain" (as the gpu engine serves it) or "compile" (``torch.compile``d, in the same CUDA graph; it
    had not finished compiling ResNet-50 after 110 s on the H200, GPU_NOTES.md session 6).
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


def engine_rate(clf, images: list[bytes], min_s: float) -> tuple[float, dict]:
    clf.classify(images[: clf.batch_size * 2])  # warm-up: graphs, cudnn plans, decoder buffers
    clf.times.__init__()
    r = rate(lambda: clf.classify(images), len(images), min_s, warmup=0)
    t = clf.times
    calls = max(1, t.images / clf.batch_size)
    per_batch = {
        "prepare_ms": round(t.prepare_s / calls * 1e3, 2),
        "net_launch_ms": round(t.network_s / calls * 1e3, 2),
        "wall_ms": round(t.total_s / calls * 1e3, 2),
    }
    return r, per_batch


def dali_only(images: list[bytes], spec: PreprocessSpec, batch: int, min_s: float) -> dict:
    """DALI alone (the gpu profile's DaliPrep: mixed decode + resize + crop + normalize, FP16 NHWC, copied into a
    torch buffer as the classifier does) at each hardware-decoder load, one and two pipelines in threads."""
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray

    from pipeline.engines.gpu.dali import DaliPrep
    from pipeline.imaging import DecodeLimits

    out = {}
    batches = [images[i : i + batch] for i in range(0, len(images) - batch + 1, batch)]
    crop_h, crop_w = spec.crop
    for load in DALI_LOADS:
        for threads in (1, 2):
            key = f"h{load}_{threads}pipe"
            try:
                prep = DaliPrep(spec, device="mixed", device_id=0, batch_size=batch, hw_decoder_load=load,
                                half=True, layout="HWC", pipelines=threads)
                bufs = [torch.empty((batch, crop_h, crop_w, 3), dtype=torch.float16, device="cuda")
                        for _ in range(threads)]
                streams = [torch.cuda.Stream() for _ in range(threads)]

                def work(k, part, prep=prep, bufs=bufs, streams=streams):
                    for b in part:
                        prep.prepare(b, [True] * len(b), DecodeLimits(),
                                     lambda o: feed_ndarray(o.as_tensor(), bufs[k], cuda_stream=streams[k]))

                def run(threads=threads, work=work):
                    if threads == 1:
                        work(0, batches)
                        return
                    ts = [threading.Thread(target=work, args=(k, batches[k::threads])) for k in range(threads)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()

                out[key] = round(rate(run, len(batches) * batch, min_s))
                prep.close()
            except Exception as e:  # noqa: BLE001 - report and continue
                out[key] = f"failed: {e}"
            print("dali only", key, out[key], flush=True)
        for depth, dali_threads, fancy in ((2, 4, True), (3, 4, True), (3, 8, True), (3, 8, False)):
            key = f"h{load}_depth{depth}_t{dali_threads}" + ("" if fancy else "_nofancy")
            try:
                out[key] = round(dali_pipelined_rate(images, spec, batch, min_s, load, depth, dali_threads,
                                                     fancy=fancy)[0])
            except Exception as e:  # noqa: BLE001 - report and continue
                out[key] = f"failed: {e}"
            print("dali only", key, out[key], flush=True)
    return out


def dali_pipelined_rate(images: list[bytes], spec: PreprocessSpec, batch: int, min_s: float, load: float,
                        depth: int, dali_threads: int, during=None, fancy: bool = True) -> tuple[float, dict]:
    """DALI alone as the classifier runs it with ``dali_depth``: one pipeline, ``depth`` batches scheduled at once
    (``depth + 1`` submitting threads), each output copied into a torch buffer. ``during``: a callable run in
    another thread for as long as the measurement (the overlap probe); its return value is given back."""
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray

    from pipeline.engines.gpu.dali import DaliPrep

    batches = [images[i : i + batch] for i in range(0, len(images) - batch + 1, batch)]
    crop_h, crop_w = spec.crop
    prep = DaliPrep(spec, device="mixed", device_id=0, batch_size=batch, hw_decoder_load=load, half=True,
                    layout="HWC", num_threads=dali_threads, depth=depth, fancy_upsampling=fancy)
    workers = depth + 1
    bufs = [torch.empty((batch, crop_h, crop_w, 3), dtype=torch.float16, device="cuda") for _ in range(workers)]
    streams = [torch.cuda.Stream() for _ in range(workers)]

    def work(k, part):
        for b in part:
            prep.run(b, lambda o: feed_ndarray(o.as_tensor(), bufs[k], cuda_stream=streams[k]))

    def run():
        ts = [threading.Thread(target=work, args=(k, batches[k::workers])) for k in range(workers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    side: dict = {}
    stop = threading.Event()
    if during is not None:
        run()  # warm-up before the side load starts
        th = threading.Thread(target=lambda: side.update(during(stop)))
        th.start()
    try:
        r = rate(run, len(batches) * batch, min_s)
    finally:
        stop.set()
        if during is not None:
            th.join()
        prep.close()
    return r, side


def network_loop(net, batch: int):
    """A callable for ``dali_pipelined_rate(during=...)``: the network's CUDA graph replayed on its own stream
    until ``stop`` is set; gives {"net_img_s": rate while it ran}."""
    import torch

    net = net.cuda().half().to(memory_format=torch.channels_last).eval()
    x = torch.randn(batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=torch.channels_last)
    s = torch.cuda.Stream()
    with torch.inference_mode(), torch.cuda.stream(s):
        for _ in range(3):
            net(x)
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            y = net(x)

    def loop(stop):
        n, t0 = 0, time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(s):
            while not stop.is_set():
                for _ in range(4):
                    g.replay()
                s.synchronize()
                n += 4
        assert y is not None  # the graph's output buffer stays alive while it replays
        return {"net_img_s": round(n * batch / (time.perf_counter() - t0))}

    return loop


def overlap_probe(images: list[bytes], spec: PreprocessSpec, net, batch: int, min_s: float) -> dict:
    """Do DALI and the network share the GPU or take turns? Each alone, then both at once (separate threads and
    streams, no data between them): if the GPU work added up, 1/dali + 1/net would bound the pair."""
    out = {"network_alone": round(model_only(net, batch, min_s))}
    for load, depth, threads, fancy in ((1.0, 3, 8, True), (0.9, 2, 4, True), (1.0, 3, 8, False)):
        key = f"h{load}_depth{depth}_t{threads}" + ("" if fancy else "_nofancy")
        alone = dali_pipelined_rate(images, spec, batch, min_s, load, depth, threads, fancy=fancy)[0]
        both, side = dali_pipelined_rate(images, spec, batch, min_s, load, depth, threads,
                                         during=network_loop(net, batch), fancy=fancy)
        net_rate = side.get("net_img_s", 0)
        out[key] = {"dali_alone": round(alone), "dali_with_net": round(both), "net_with_dali": net_rate,
                    "serial_bound": round(1 / (1 / alone + 1 / out["network_alone"]))}
        print("overlap", key, out[key], flush=True)
    return out


def oddities_part(results: dict, net, spec) -> None:
    """tests/support/oddities.py through the gpu engine (DALI) on the device vs the onnx engine: statuses and error kinds."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.oddities import oddities

    from pipeline.engines.onnx import OnnxEngine
    from pipeline.engines.gpu.classifier import GpuClassifier
    from pipeline.model import load_model

    odd = oddities()
    names = list(odd)
    datas = [odd[n][0] for n in names]
    ref = OnnxEngine(load_model(None), top_k=5).classify(datas)
    clf = GpuClassifier(net, spec, top_k=5, batch_size=8)
    raw = clf.classify(datas)
    clf.close()
    rows, same = {}, 0
    for i, name in enumerate(names):
        gpu = ("error", raw.errors[i].split(":", 1)[0]) if raw.errors[i] else ("ok", None)
        onnx = (ref[i].status, ref[i].error.split(":", 1)[0] if ref[i].error else None)
        rows[name] = {"gpu": gpu, "onnx": onnx, "top1": [int(raw.class_ids[i, 0]), (ref[i].class_ids or [None])[0]]}
        same += gpu == onnx
    results["oddities"] = {"same_status_and_kind": f"{same}/{len(names)}", "rows": rows}


# ---- Triton -----------------------------------------------------------------------------------------------


def metrics(url: str) -> dict[str, dict[str, float]]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for key in ("nv_inference_count", "nv_inference_exec_count", "nv_inference_request_success"):
            if line.startswith(key + "{"):
                model = line.split('model="')[1].split('"')[0]
                out.setdefault(model, {})[key] = float(line.rsplit(" ", 1)[1])
    return out


def _tree_cpu(pid) -> float:
    """CPU seconds (user + system) of a process and its descendants so far."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class _Labels:
    labels = tuple(str(i) for i in range(1000))


def _spy(server_pid: int, path: Path, seconds: float = 2.0) -> threading.Thread:
    """py-spy samples (native frames too) of every python backend stub under the server at once, for ``seconds``,
    as raw collapsed stacks with thread names (where the stubs' CPU goes); runs in a thread, starts at once."""
    import psutil

    def go():
        stubs = [p.pid for p in psutil.Process(server_pid).children(recursive=True)
                 if "triton_python_backend_stub" in " ".join(p.cmdline())]
        outs = [path.with_name(f"{path.stem}_{pid}.txt") for pid in stubs]
        procs = [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
                                   "100", "--format", "raw", "--threads", "--native", "--output", str(out)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for pid, out in zip(stubs, outs)]
        for proc in procs:
            try:
                proc.wait(timeout=seconds + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
        with path.open("w") as f:
            for pid, out in zip(stubs, outs):
                f.write(f"# stub {pid}\n")
                if out.is_file():
                    f.write(out.read_text(errors="replace"))
                    out.unlink()

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


def _client_proc(url: str, model: str, images_file: str, request_batch: int, concurrency: int, seconds: float,
                 start, out) -> None:
    """One actor-shaped client process: TritonEngine.classify of the whole set, again and again, for ``seconds``
    after ``start`` is set; puts (images, wall s, CPU s of this process) on ``out``."""
    import pickle

    from pipeline.engines.triton import TritonEngine

    images = pickle.loads(Path(images_file).read_bytes())
    eng = TritonEngine(_Labels(), url=url, model_name=model, request_batch=request_batch, concurrency=concurrency)
    try:
        eng.classify(images[: request_batch * concurrency * 2])  # warm-up
        start.wait()
        done, c0, t0 = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            done += len(eng.classify(images))
        out.put((done, time.perf_counter() - t0, time.process_time() - c0))
    finally:
        eng.close()


def _procs_rate(url: str, model: str, images: list[bytes], request_batch: int, concurrency: int, procs: int,
                seconds: float, on_start=None) -> tuple[float, float]:
    """img/s of ``procs`` client processes at once (several actors sharing one server), and their cores."""
    import multiprocessing as mp
    import pickle

    ctx = mp.get_context("spawn")  # this process holds CUDA and gRPC state: never fork it
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        f.write(pickle.dumps(images))
    start, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_client_proc, args=(url, model, f.name, request_batch, concurrency, seconds,
                                                        start, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    time.sleep(6)  # imports, channel, warm-up of every process
    if on_start is not None:
        on_start()  # the timed window starts now (server CPU, metrics)
    start.set()
    got, deadline = [], time.monotonic() + seconds + 300
    while len(got) < procs:  # a client process that died must not hold the device call for minutes
        try:
            got.append(out.get(timeout=2))
        except queue.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for w in workers:
                    w.kill()
                raise RuntimeError(f"client processes failed (exit codes {dead}) or timed out") from None
    for w in workers:
        w.join(30)
    os.unlink(f.name)
    return sum(g[0] / g[1] for g in got), sum(g[2] / g[1] for g in got)


def triton_part(args, results: dict, sets: dict[str, list[bytes]]) -> None:
    """The gpu profile in a local tritonserver (one request stream per model instance), from clients shaped like the
    actor: ResNet-50, the default model, and the hop alone (``network: none``: the model's execute(), stream and
    responses with a classifier that does no work). One server per ``--servers`` entry: N model instances (each its
    own stub process, classifier and CUDA context), ":mps" under a private CUDA MPS daemon."""
    for spec in args.servers:
        instances, *flags = spec.split(":")
        sync = next((f for f in flags if f in ("auto", "spin", "block")), None)
        backlog = next((f[2:] for f in flags if re.fullmatch(r"bl\d+(\.\d+)?", f)), None)
        if not instances.isdigit() or set(flags) - {"mps", "auto", "spin", "block", "ens", f"bl{backlog}"}:
            raise SystemExit(f"--servers entry {spec!r}: write N[:mps][:block|spin|auto][:ens][:blB] (N model "
                             "instances, optionally under MPS, how the model's threads wait for the GPU, :ens for the "
                             "ensemble shape, N preprocess instances + --network-instances; :blB a backlog of B "
                             "batches per instance, 0 for none)")
        suffix = (f"_i{instances}" + ("_mps" if "mps" in flags else "") + (f"_{sync}" if sync else "")
                  + ("_ens" if "ens" in flags else "") + (f"_bl{backlog}" if backlog is not None else ""))
        shape = "ensemble" if "ens" in flags else "single"
        options = {} if backlog is None else {"max_backlog": float(backlog)}
        if "mps" not in flags:
            _triton_server_runs(args, results, sets, int(instances), suffix, sync, shape, options)
            continue
        from gpu_mps import log_tail, mps

        folder = Path(tempfile.mkdtemp(prefix="mps-"))
        try:
            with mps(folder) as logs:
                try:
                    _triton_server_runs(args, results, sets, int(instances), suffix, sync, shape, options)
                finally:
                    results[f"mps_log{suffix}"] = log_tail(logs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _add_models(built: Path, repo: Path, name: str, spec: PreprocessSpec | None) -> None:
    """Moves a built gpu repository's models into ``repo`` under ``name`` (an ensemble's two steps: name + suffix),
    so one server holds every net; ``spec`` replaces their preprocess.json."""
    renames = {"classifier": name, "preprocess": f"{name}_preprocess", "network": f"{name}_network"}
    for old, new in renames.items():
        if not (built / old).is_dir():
            continue
        (built / old).rename(repo / new)
        cfg = repo / new / "config.pbtxt"
        text = cfg.read_text().replace(f'name: "{old}"', f'name: "{new}"')
        for step, step_new in list(renames.items())[1:]:
            text = text.replace(f'model_name: "{step}"', f'model_name: "{step_new}"')
        cfg.write_text(text)
        if spec is not None and (repo / new / "1" / "preprocess.json").is_file():
            (repo / new / "1" / "preprocess.json").write_text(spec.to_json())


def _triton_server_runs(args, results: dict, sets: dict[str, list[bytes]], instances: int, suffix: str,
                        cuda_sync: str | None = None, shape: str = "single", options: dict | None = None) -> None:
    from bench_scaleout import SmiSampler

    from pipeline.engines.triton import TritonEngine
    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.server import TritonServer

    repo = Path(tempfile.mkdtemp(prefix="gpu-repo-"))
    models = {"resnet50": "classifier_resnet50", "default": "classifier", "hop": "classifier_hop"}
    models = {net: name for net, name in models.items() if net in args.triton_nets.split(",")}
    for net, name in models.items():
        tmp = Path(tempfile.mkdtemp(prefix=f"gpu-{net}-"))
        ens = {"network_instances": args.network_instances} if shape == "ensemble" else {}
        build_gpu_repository(
            None, tmp, shape=shape, **ens,
            network={"resnet50": "resnet50", "hop": "none"}.get(net, "auto"), instances=instances,
            **({} if args.triton_batch is None else {"batch_size": args.triton_batch}),
            max_batch_size=args.triton_max_batch, decoder=args.decoder,
            queue_delay_us=args.queue_delay_us, prep_workers=args.prep_workers,
            hw_decoder_load=args.hw_decoder_load, half=args.half if net == "default" else "true",
            dali_depth=args.dali_depth, dali_threads=args.dali_threads, cuda_sync=cuda_sync, **(options or {}),
        )
        _add_models(tmp, repo, name, IMAGENET_SPEC if net == "resnet50" else None)

    t0 = time.perf_counter()
    # The python backend moves inputs through shared memory that starts at 1 MB and grows 1 MB at a time:
    # start it large enough for several multi-MB requests.
    shm_args = ["--backend-config=python,shm-default-byte-size=268435456",
                "--backend-config=python,shm-growth-byte-size=67108864"]
    sampler = SmiSampler(args.out / f"nvidia_smi{suffix}.csv", period_ms=250)
    try:
        with TritonServer(repo, startup_timeout_s=300, extra_args=shm_args) as server:
            results[f"triton_startup_s{suffix}"] = round(time.perf_counter() - t0, 1)

            def bad_inputs():
                # Bad inputs inside a request: each must come back as its own error row, the rest classified.
                eng = TritonEngine(_Labels(), url=server.grpc_url, request_batch=8, concurrency=1,
                                   model_name=models.get("default", next(iter(models.values()))))
                bench_set = sets["imagenet"]
                mixed = [bench_set[0], bench_set[1][: len(bench_set[1]) // 2], b"not an image", bench_set[2]]
                rows = eng.classify(mixed)
                eng.close()
                results[f"triton_bad_inputs{suffix}"] = [(r.status, r.error, r.class_ids[:1], r.width) for r in rows]
                print("triton bad inputs:", results[f"triton_bad_inputs{suffix}"], flush=True)

            runs = [(s, n) for s in sets for n in models if n in ("resnet50", "hop") or s == "imagenet"]
            timed = [(set_name, net, pair, procs) for (set_name, net), pair in itertools.product(runs, args.client)
                     for procs in args.client_procs]
            if args.bad_inputs == "before":
                bad_inputs()
            for i, run in enumerate(timed):
                _timed_run(args, results, server, models, sets, sampler, instances, suffix, *run)
                if i == 0 and args.bad_inputs == "between":
                    # The same run again after the bad-inputs request (session 5's lead: was the model that got it
                    # the slow one?).
                    bad_inputs()
                    _timed_run(args, results, server, models, sets, sampler, instances, suffix + "_afterbad", *run)
            if args.bad_inputs == "after":
                bad_inputs()
            results[f"triton_log_tail{suffix}"] = server.log_tail(15)
        # Each instance's share of the work, from the models' finalize lines (the log of the stopped server).
        results[f"streams{suffix}"] = [line.split("gpu stream of ", 1)[1].rstrip('"')
                                       for line in server.stopped_log.splitlines() if "gpu stream of " in line]
        for line in results[f"streams{suffix}"]:
            print(f"streams{suffix}: {line}", flush=True)
    finally:
        sampler.stop()


def _timed_run(args, results: dict, server, models: dict, sets: dict, sampler, instances: int, suffix: str,
               set_name: str, net: str, pair: tuple[int, int], procs: int) -> None:
    """One timed run of actor-shaped clients against one model of a running server; its row goes to ``results``."""
    from bench_scaleout import gpu_summary

    from pipeline.engines.triton import TritonEngine

    request_batch, concurrency = pair
    name = models[net]
    images = sets[set_name] * max(1, args.triton_images // len(sets[set_name]))
    key = f"triton_{net}_{set_name}_r{request_batch}_c{concurrency}" + (f"_p{procs}" if procs > 1 else "") + suffix
    if procs == 1:
        eng = TritonEngine(_Labels(), url=server.grpc_url, model_name=name,
                           request_batch=request_batch, concurrency=concurrency)
        try:
            eng.classify(images[: request_batch * concurrency * 2])  # warm-up
            before = metrics(server.metrics_url).get(name, {})
            cpu0, srv0, w0, t0 = time.process_time(), _tree_cpu(server.pid), time.perf_counter(), time.time()
            spy = _spy(server.pid, args.out / f"spy_{key}.txt") if args.py_spy else None
            r = rate(lambda: eng.classify(images), len(images), args.seconds, warmup=0)
            if spy is not None:
                spy.join()
            client_cores = (time.process_time() - cpu0) / (time.perf_counter() - w0)
        finally:
            eng.close()
    else:
        mark: dict = {}

        def started():
            mark.update(before=metrics(server.metrics_url).get(name, {}), srv0=_tree_cpu(server.pid),
                        w0=time.perf_counter(), t0=time.time())
            if args.py_spy:
                mark["spy"] = _spy(server.pid, args.out / f"spy_{key}.txt")

        r, client_cores = _procs_rate(server.grpc_url, name, images, request_batch, concurrency, procs, args.seconds,
                                      on_start=started)
        before, srv0, w0, t0 = mark["before"], mark["srv0"], mark["w0"], mark["t0"]
        if "spy" in mark:
            mark["spy"].join()
    srv1, w1 = _tree_cpu(server.pid), time.perf_counter()
    after = metrics(server.metrics_url).get(name, {})
    execs = after.get("nv_inference_exec_count", 0) - before.get("nv_inference_exec_count", 0)
    gpu = gpu_summary(sampler.samples(), t0, time.time()).get(0, {})
    results[key] = {
        "img_s": round(r),
        "client_procs": procs,
        "instances": instances,
        "requests_per_execute": round((after.get("nv_inference_request_success", 0)
                                       - before.get("nv_inference_request_success", 0)) / max(execs, 1), 2),
        "inference_count": after.get("nv_inference_count", 0) - before.get("nv_inference_count", 0),
        "exec_count": execs,
        "client_cores": round(client_cores, 2),  # the actor-shaped client process(es)
        "server_cores": round((srv1 - srv0) / (w1 - w0), 2),  # tritonserver and its stubs
        "gpu_util_mean": gpu.get("util_mean"),  # nvidia-smi over the timed window
        "timed_s": round(w1 - w0, 2),
    }
    print(f"{key}: {results[key]}", flush=True)
    (args.out / "bench_gpu.json").write_text(json.dumps(results, indent=2, default=str))


# ---- parity -----------------------------------------------------------------------------------------------


def parity(results: dict, clf_default, clf_fp32=None) -> None:
    """Top-1 agreement of the gpu engine (FP16, GPU decode and resize) with the ONNX Runtime CPU reference."""
    from pipeline.model import load_model

    parity_set = make_set(520, "varied", 10_000)
    bundle = load_model(None)
    try:
        from pipeline.engines.onnx import OnnxEngine

        ref_engine = OnnxEngine(bundle, top_k=5)
        ref = ref_engine.classify(parity_set)
        ref_engine.close()
    except ImportError:
        raise SystemExit("pipeline.engines.onnx.OnnxEngine is needed for the parity check")
    for label, clf in (("parity", clf_default), ("parity_fp32_network", clf_fp32)):
        if clf is not None:
            _compare(results, label, parity_set, ref, clf.classify(parity_set))


def _compare(results: dict, label: str, parity_set: list[bytes], ref, raw) -> None:
    agree, n, dprob, disagreements = 0, 0, [], []
    decisive, decisive_agree = 0, 0
    for i, r in enumerate(ref):
        if r.status != "ok" or raw.errors[i]:
            disagreements.append({"i": i, "ref": r.error, "gpu": raw.errors[i]})
            continue
        n += 1
        g1 = int(raw.class_ids[i, 0])
        margin = r.scores[0] - (r.scores[1] if len(r.scores) > 1 else 0.0)
        if margin > 0.01:  # the reference's top-1 leads its top-2 by more than 1 point
            decisive += 1
            decisive_agree += int(g1 == r.class_ids[0])
        if g1 == r.class_ids[0]:
            agree += 1
            dprob.append(abs(float(raw.scores[i, 0]) - r.scores[0]))
        else:
            disagreements.append({
                "i": i, "ref_top2": r.class_ids[:2], "ref_p": [round(p, 4) for p in r.scores[:2]],
                "gpu_top2": raw.class_ids[i, :2].tolist(), "gpu_p": [round(float(p), 4) for p in raw.scores[i, :2]],
            })
    results[label] = {
        "images": len(parity_set),
        "decisive_images": decisive,
        "decisive_top1_agreement": round(decisive_agree / max(decisive, 1), 4),
        "mean_kb": round(sum(map(len, parity_set)) / len(parity_set) / 1024, 1),
        "compared": n,
        "top1_agreement": round(agree / max(n, 1), 4),
        "mean_abs_top1_prob_diff": round(float(np.mean(dprob)) if dprob else 0.0, 5),
        "max_abs_top1_prob_diff": round(float(np.max(dprob)) if dprob else 0.0, 5),
        "disagreements": disagreements[:20],
    }


# ---- main -------------------------------------------------------------------------------------------------


def _client_pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in pair.split("x")) for pair in text.split(",")]  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_gpu_out"))
    p.add_argument("--images", type=int, default=2048, help="unique JPEGs in the benchmark set")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per measurement")
    p.add_argument("--decoder", default="auto")
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
    try:  # a removed decoder fails here, not after the parts that run before Triton
        check_gpu_decoder(args.decoder)
    except ConfigError as err:
        p.error(f"--decoder: {err}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    import torch

    from pipeline.engines.gpu.classifier import GpuClassifier

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
                    clf = GpuClassifier(net, spec, top_k=5, batch_size=args.batch, **options)
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
        clf = GpuClassifier(net, spec, top_k=5, batch_size=args.batch, decoder=args.decoder, half=True, **deep)
        clf32 = GpuClassifier(net, spec, top_k=5, batch_size=args.batch, decoder=args.decoder, half=False, **deep)
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
