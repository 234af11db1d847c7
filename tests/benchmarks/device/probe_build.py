"""Where a GPU classifier's build goes, in 1 and in N processes at once (as N Triton model instances start).

    python tests/benchmarks/device/probe_build.py [N [CUDNN ...]]    (default 6 benchmark; N processes share a
        private MPS daemon; CUDNN: benchmark (the engine's), limitK (cudnn.benchmark_limit=K) or off)

Each process times: import torch, the CUDA context, the network (weights), the ``gpu`` engine's classifier
(CUDA-graph capture, DALI pipelines) and the built network's img/s (40 graph replays at its batch, alone on the
GPU in the 1-process rows), and prints one JSON line; the table gives each step's median and max.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHILD = r'''
import json, logging, sys, time
sys.path.insert(0, sys.argv[1])
t = {"start": time.perf_counter()}
marks = []
class Mark(logging.Handler):
    def emit(self, record):
        marks.append((round(time.perf_counter() - t["start"], 2), record.getMessage()[:90]))
logging.basicConfig(level=logging.INFO, handlers=[Mark()])
import os
import torch
t["import torch"] = time.perf_counter()
import pipeline.gpu.classifier as classifier_module
cudnn = os.environ.get("PROBE_CUDNN", "benchmark")
_use = classifier_module.use_cuda_device
def use_cuda_device(torch_, device, mode):
    in_force = _use(torch_, device, mode)
    if cudnn == "off":
        torch.backends.cudnn.benchmark = False
    elif cudnn.startswith("limit"):
        torch.backends.cudnn.benchmark_limit = int(cudnn[5:])
    return in_force
classifier_module.use_cuda_device = use_cuda_device
torch.zeros(1, device="cuda").sum().item()
t["cuda context"] = time.perf_counter()
from pipeline.model.folder import load_model
from pipeline.gpu.networks import load_network
bundle = load_model(None)
network = load_network(bundle)
t["network + weights"] = time.perf_counter()
from pipeline.engines.gpu import GpuEngine
engine = GpuEngine(bundle, top_k=5, network=network)
t["classifier (graph, DALI)"] = time.perf_counter()
net = engine.classifier.network
x = torch.zeros(net.batch_size, 3, *net.crop, dtype=net.dtype, device=net.device)
x = x.contiguous(memory_format=torch.channels_last)
net.scores(x); torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(40):
    net.scores(x)
torch.cuda.synchronize()
rate = 40 * net.batch_size / (time.perf_counter() - t0)
engine.close()
keys = list(t)
out = {k: round(t[k] - t[p], 2) for p, k in zip(keys, keys[1:])}
out["total"] = round(t[keys[-1]] - t["start"], 2)
out["marks"] = marks
out["net img/s"] = round(rate)
out["cudnn"] = cudnn
print("RESULT " + json.dumps(out), flush=True)
'''


def run(n: int, env: dict | None, cudnn: str) -> list[dict]:
    env = {**(env or os.environ), "PROBE_CUDNN": cudnn}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        if not found:
            print(f"a build failed (rc {p.returncode}):", *err.splitlines()[-6:], sep="\n    ")
        results += found
    return results


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from pipeline.triton.mps import MpsDaemon

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    variants = sys.argv[2:] or ["benchmark"]
    steps = ("import torch", "cuda context", "network + weights", "classifier (graph, DALI)", "total")
    print(f"{'cudnn':>9} | {'processes':>9} | " + " | ".join(f"{k:>24}" for k in steps) + " | net img/s")
    for cudnn in variants:
        for count in (1, n):
            daemon = MpsDaemon() if count > 1 else None
            env = {**os.environ, **daemon.start()} if daemon else None
            t0 = time.perf_counter()
            try:
                results = run(count, env, cudnn)
            finally:
                if daemon:
                    daemon.stop()
            wall = time.perf_counter() - t0
            cells = []
            for key in (*steps, "net img/s"):
                vals = [r[key] for r in results]
                cells.append(f"{statistics.median(vals):>11.2f} (max {max(vals):>6.2f})" if vals else f"{'-':>24}")
            print(f"{cudnn:>9} | {count:>9} | " + " | ".join(cells) + f"   wall {wall:.1f} s, {len(results)}/{count} ok")
            if results and count == 1:
                for mark in results[0]["marks"]:
                    print(f"          {mark[0]:>7.2f} s  {mark[1]}")


if __name__ == "__main__":
    main()
