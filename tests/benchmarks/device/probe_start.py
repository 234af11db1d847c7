"""Where a gpu-profile tritonserver's start goes: imports, then each instance's load, from the server's own log.

    python tests/benchmarks/device/probe_start.py [INSTANCES ...]
"""

import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

for module in ("torch", "nvidia.dali", "tritonclient.grpc", "ray", "ray.data", "pipeline.gpu.classifier"):
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    print(f"import {module}: {time.perf_counter() - t:.2f} s (a fresh process)")

from pipeline.model.folder import load_model  # noqa: E402
from pipeline.triton.mps import MpsDaemon  # noqa: E402
from pipeline.triton.profiles import PROFILES  # noqa: E402
from pipeline.triton.repository_cache import cached_repository  # noqa: E402
from pipeline.triton.server import TritonServer  # noqa: E402

KEEP = re.compile(r"ModelInstanceInitialize|successfully loaded|loading: |Started GRPC|gpu model|stub", re.I)
for n in [int(a) for a in sys.argv[1:]] or [6]:
    gpu = PROFILES["gpu"]
    t0 = time.perf_counter()
    repo = cached_repository(gpu, load_model(None), top_k=5, instances=n)
    t_repo = time.perf_counter()
    daemon = MpsDaemon()
    env = daemon.start()
    t_mps = time.perf_counter()
    server = TritonServer(repo, extra_args=gpu.server_args(), env=env, startup_timeout_s=300)
    server.start()
    t_ready = time.perf_counter()
    text = server._log_path.read_text(errors="replace")
    server.stop()
    t_stop = time.perf_counter()
    daemon.stop()
    print(f"instances={n}: repository {t_repo - t0:.2f} s, mps {t_mps - t_repo:.2f} s, server ready "
          f"{t_ready - t_mps:.2f} s, stop {t_stop - t_ready:.2f} s")
    for line in text.splitlines():
        if KEEP.search(line):
            print("   ", line[:220])
