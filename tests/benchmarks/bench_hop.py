"""The Triton hop alone: what it costs to move an actor's encoded files into the gpu profile's model and the answers
back, with a model that does no work (hop_model.py), side by side in one run.

Rows differ in the client's wire format (``message``: a ModelInferRequest message with the files appended, the
engine's path before ``pipeline.triton.wire.encode_request``; ``encoded``: the request serialized by us, the files copied
once), in the model's instances (stub processes) and in the client processes (actors) sending at once. Variants
alternate round by round, and each row is the median round. CPU figures are per image: the client processes, and
the server with its stub processes. Every answer is checked against its own image.

On this machine's CPUs (``--kind cpu``, the default) read the ratios and the CPU per image; on the GPU machine
(``--kind gpu``) the img/s too.

    python tests/benchmarks/bench_hop.py --images 512 --rounds 5
    python tests/benchmarks/bench_hop.py --kind gpu --instances 1,3 --client-procs 1,3 --images 2048
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing as mp
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))

from hop_model import serve_hop  # noqa: E402
from pipeline.engines.triton import TritonEngine  # noqa: E402
from pipeline.triton.wire import _lengths, _padded, _tag_bytes, request_header  # noqa: E402

WIRES = ("message", "encoded")
PYTHON_SHM_ARGS = ["--backend-config=python,shm-default-byte-size=268435456",
                   "--backend-config=python,shm-growth-byte-size=67108864"]


def build_request(model_name: str, blobs: list[bytes], outputs, limits, tags):
    """The request as a protobuf message (three copies of the files): ``pipeline.triton.wire.encode_request``'s reference."""
    longest = max(1, max(len(b) for b in blobs))
    request = request_header(model_name, len(blobs), longest, outputs, limits)
    request.raw_input_contents.append(b"".join(_padded(blobs, longest)))
    request.raw_input_contents.append(_lengths(blobs))
    request.raw_input_contents.append(_tag_bytes(tags, len(blobs)))
    return request


class Labels:
    labels = tuple(str(i) for i in range(1000))


class MessageWireEngine(TritonEngine):
    """The engine with its requests built as protobuf messages (three copies of the files)."""

    def _request(self, blobs, tags):
        return build_request(self.model_name, blobs, self._wanted, self.limits, tags)


def engine(wire: str, url: str, model: str, request_batch: int, concurrency: int) -> TritonEngine:
    cls = MessageWireEngine if wire == "message" else TritonEngine
    return cls(Labels(), url=url, model_name=model, request_batch=request_batch, concurrency=concurrency)


def check(rows, images) -> None:
    from hop_model import echo_ids

    want = echo_ids(images, 5)
    bad = [i for i, r in enumerate(rows) if r.status != "ok" or [int(c) for c in r.labels] != want[i].tolist()]
    assert not bad, f"{len(bad)} answers are not their own image's, first {rows[bad[0]]}"


def client(wire, url, model, request_batch, concurrency, images_file, calls, start, out) -> None:
    """One actor-shaped client process: ``calls`` classify() calls of the whole set after ``start``; puts
    (images, wall s, CPU s) on ``out``."""
    images = pickle.loads(Path(images_file).read_bytes())
    eng = engine(wire, url, model, request_batch, concurrency)
    try:
        check(eng.classify(images), images)  # warm-up, and every answer is its own image's
        start.wait()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            eng.classify(images)
        out.put((calls * len(images), time.perf_counter() - t0, time.process_time() - c0))
    finally:
        eng.close()


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of the server (key 0) and of each of its stub processes (by pid)."""
    import psutil

    root = psutil.Process(pid)
    cpu = {}
    for proc in (root, *root.children(recursive=True)):
        try:
            times = proc.cpu_times()
            cpu[0 if proc.pid == pid else proc.pid] = times.user + times.system
        except psutil.Error:
            pass
    return cpu


def one_round(server, wire, model, procs, args, images_file, n_images) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=client, args=(wire, server.grpc_url, model, args.request_batch, args.concurrency,
                                               images_file, args.calls, start, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    time.sleep(args.settle_s)  # imports, channels, warm-up call of every client
    s0, t0 = tree_cpu(server.pid), time.perf_counter()
    start.set()
    got = [out.get(timeout=600) for _ in workers]
    wall, s1 = time.perf_counter() - t0, tree_cpu(server.pid)
    used = {k: v - s0.get(k, 0.0) for k, v in s1.items()}
    stubs = sorted((v for k, v in used.items() if k), reverse=True)
    for w in workers:
        w.join(30)
    images = sum(g[0] for g in got)
    return {"img_s": sum(g[0] / g[1] for g in got), "client_us": sum(g[2] for g in got) / images * 1e6,
            "server_us": sum(used.values()) / images * 1e6, "wall": wall,
            # the busiest stub's share of the stubs' CPU: 1/instances when the server spreads requests evenly
            "top_stub": stubs[0] / max(sum(stubs), 1e-9) if stubs else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("cpu", "gpu"), default="cpu", help="the model's instance kind")
    p.add_argument("--images", type=int, default=512, help="images per classify() call (imagenet-like, ~98 KB)")
    p.add_argument("--calls", type=int, default=3, help="classify() calls per client per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--wires", default=",".join(WIRES))
    p.add_argument("--instances", default="1,2", help="model instances (stub processes), comma separated")
    p.add_argument("--client-procs", default="1", help="client processes at once, comma separated")
    p.add_argument("--request-batch", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=256, help="the model's batch")
    p.add_argument("--settle-s", type=float, default=8.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from image_sets import make_set

    from pipeline.triton import contract as tn
    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.server import TritonServer

    images = make_set(args.images, "imagenet", 0)
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        f.write(pickle.dumps(images))
    repo = Path(tempfile.mkdtemp(prefix="hop-repo-"))
    instances = [int(v) for v in args.instances.split(",")]
    for n in instances:
        tmp = serve_hop(build_gpu_repository(None, Path(tempfile.mkdtemp()), instances=n,
                                                   batch_size=args.batch_size))
        name = f"hop_i{n}"
        (tmp / tn.MODEL_NAME).rename(repo / name)
        cfg = repo / name / "config.pbtxt"
        text = cfg.read_text().replace(f'name: "{tn.MODEL_NAME}"', f'name: "{name}"')
        cfg.write_text(text.replace("KIND_GPU", "KIND_CPU") if args.kind == "cpu" else text)
    variants = list(itertools.product(args.wires.split(","), instances,
                                      [int(v) for v in args.client_procs.split(",")]))
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}
    with TritonServer(repo, startup_timeout_s=300, extra_args=PYTHON_SHM_ARGS) as server:
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                wire, n, procs = v
                runs[v].append(one_round(server, wire, f"hop_i{n}", procs, args, f.name, len(images)))
                print(f"round {r} {v}: {runs[v][-1]}", flush=True)
    Path(f.name).unlink()

    mean_kb = sum(map(len, images)) / len(images) / 1024
    print(f"\nThe hop alone ({args.kind}): {len(images)} files of {mean_kb:.1f} KB per call, requests of "
          f"{args.request_batch} x {args.concurrency} in flight per client, median of {args.rounds} alternating "
          "rounds; ratio = img/s / first row's; CPU per image of the clients and of the server with its stubs")
    print("| wire | instances | client procs | img/s | ratio | client CPU us/img | server CPU us/img | busiest stub |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for v in variants:
        med = {k: statistics.median(run[k] for run in runs[v]) for k in ("img_s", "client_us", "server_us", "top_stub")}
        base = base or med["img_s"]
        print(f"| {v[0]} | {v[1]} | {v[2]} | {med['img_s']:,.0f} | {med['img_s'] / base:.2f} | "
              f"{med['client_us']:.0f} | {med['server_us']:.0f} | {med['top_stub']:.0%} |")


if __name__ == "__main__":
    main()
