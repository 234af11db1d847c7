"""DALI alone on the GPU (the gpu profile's DaliPrep at each hardware-decoder load, one or two pipelines, or one
pipeline several batches deep) and the overlap probe (DALI while the network replays in another thread)."""

from __future__ import annotations

import threading
import time

from gpu_timing import model_only, rate
from pipeline.model.imaging import PreprocessSpec

DALI_LOADS = (0.65, 0.9, 1.0)  # the hardware JPEG engines' share of each batch


def dali_only(images: list[bytes], spec: PreprocessSpec, batch: int, min_s: float) -> dict:
    """DALI alone (the gpu profile's DaliPrep: mixed decode + resize + crop + normalize, FP16 NHWC, copied into a
    torch buffer as the classifier does) at each hardware-decoder load, one and two pipelines in threads."""
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray

    from pipeline.gpu.dali import DaliPrep
    from pipeline.model.imaging import DecodeLimits

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

    from pipeline.gpu.dali import DaliPrep

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
