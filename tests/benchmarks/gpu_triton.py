"""The gpu profile in a local tritonserver, timed from actor-shaped clients: one server per ``--servers`` entry (model
instances, MPS, GPU waits, the ensemble shape of gpu_ensemble.py, backlog), ResNet-50, the default model and the hop
alone in it; img/s, requests per execute(), client and server cores, GPU utilisation, the bad-inputs request, each
instance's share."""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from gpu_timing import IMAGENET_SPEC, rate
from pipeline.model.imaging import PreprocessSpec
from pipeline.model.folder import SPEC_FILE


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
    """What the client reads of a bundle served here: its name, 1,000 labels, and a spec without an embedding."""

    name = "served"
    labels = tuple(str(i) for i in range(1000))
    num_classes = len(labels)

    @property
    def spec(self):
        from pipeline.model.folder import default_model_spec

        return default_model_spec()


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
    actor: ResNet-50, the default model, and the hop alone (hop_model.py: the model's execute(), stream and
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
        if spec is not None and (repo / new / "1" / SPEC_FILE).is_file():
            (repo / new / "1" / SPEC_FILE).write_text(spec.to_json())


def _triton_server_runs(args, results: dict, sets: dict[str, list[bytes]], instances: int, suffix: str,
                        cuda_sync: str | None = None, shape: str = "single", options: dict | None = None) -> None:
    from bench_scaleout import SmiSampler
    from gpu_ensemble import build_ensemble_repository
    from gpu_networks import served
    from hop_model import serve_hop

    from pipeline.engines.triton import TritonEngine
    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.server import TritonServer

    repo = Path(tempfile.mkdtemp(prefix="gpu-repo-"))
    models = {"resnet50": "classifier_resnet50", "default": "classifier", "hop": "classifier_hop"}
    models = {net: name for net, name in models.items() if net in args.triton_nets.split(",")}
    for net, name in models.items():
        tmp = Path(tempfile.mkdtemp(prefix=f"gpu-{net}-"))
        ens = {"network_instances": args.network_instances} if shape == "ensemble" else {}
        (build_ensemble_repository if shape == "ensemble" else build_gpu_repository)(
            None, tmp, **ens,
            network=served("resnet50") if net == "resnet50" else "auto", instances=instances,
            **({} if args.triton_batch is None else {"batch_size": args.triton_batch}),
            max_batch_size=args.triton_max_batch,
            queue_delay_us=args.queue_delay_us, prep_workers=args.prep_workers,
            hw_decoder_load=args.hw_decoder_load, half=args.half if net == "default" else "true",
            dali_depth=args.dali_depth, dali_threads=args.dali_threads, cuda_sync=cuda_sync, **(options or {}),
        )
        if net == "hop":
            serve_hop(tmp)
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
                    # The same run again after the bad-inputs request: is the model that got it the slow one?
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
