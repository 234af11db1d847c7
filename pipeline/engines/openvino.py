"""The ``openvino`` engine: the onnx engine's decoding and batching, with OpenVINO running the network on the CPU.

It exists for INT8 models on Intel CPUs with AMX, where OpenVINO's integer kernels beat ONNX Runtime's; with FP32
models, and on an AVX2 CPU, it is no faster than onnx (docs/performance.md, "The openvino engine"). It reads the same
model folders, ``model.onnx`` included, and classifies FP32 models like onnx to within float rounding."""

from __future__ import annotations

import importlib.util
import threading
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from pipeline.engines.base import EngineSpec, positive_int
from pipeline.engines.onnx import CALL_THREADS_DEFAULT, DECODE_THREADS_OPTION, DEFAULT_MAX_BATCH, OnnxEngine
from pipeline.errors import ConfigError, EngineError
from pipeline.model.folder import ModelBundle
from pipeline.model.imaging import DecodeLimits
from pipeline.model.onnx_graph import network_outputs, runtime_graph
from pipeline.schema import DEFAULT_TOP_K

MISSING_OPENVINO = ("--engine openvino needs the openvino package: pip install 'bulk-classify[openvino]', or use "
                    "--engine onnx")
# Runs one actor's engine takes at once when built on its own; in a job, the actor's calls (SPEC.calls_option).
DEFAULT_STREAMS = 2

SPEC = EngineSpec(
    name="openvino",
    factory=f"{__name__}:OpenVinoEngine",
    summary="OpenVINO on the actor's CPU cores, for INT8 models on Intel CPUs with AMX",
    options=(
        DECODE_THREADS_OPTION,
        positive_int("threads", f"OpenVINO threads per run, e.g. 2 ({CALL_THREADS_DEFAULT})"),
        positive_int("streams", "OpenVINO runs at once, e.g. 2 (default in a job: --calls-per-actor)"),
        positive_int("max_batch", "images per OpenVINO run, e.g. 8"),
    ),
    decode_threads_option="decode_threads",
    call_threads_option="threads",
    calls_option="streams",
    preflight=f"{__name__}:check_requirements",
    # The onnx engine's shape: one call's batch decodes on the pool while the other's runs the network.
    calls_per_actor=2,
    int8="INT8 models: yes (OpenVINO's integer kernels, faster than onnx's on an AMX Xeon)",
    several_models=True,
)


def check_requirements(options: Mapping[str, Any]) -> None:
    """The openvino engine's preflight: the ``openvino`` package is installed (the ``openvino`` extra)."""
    if importlib.util.find_spec("openvino") is None:
        raise ConfigError(MISSING_OPENVINO)


class OpenVinoEngine(OnnxEngine):
    """Classifies encoded images with OpenVINO on the CPU; decoding runs on a thread pool (as ``OnnxEngine``).

    Args:
        bundle, top_k, limits, decode_threads, max_batch, more: as ``OnnxEngine``.
        threads: OpenVINO's threads per run.
        streams: runs at once: the calls that will use the engine concurrently, each on its own stream.
    """

    name = "openvino"

    def __init__(
        self,
        bundle: ModelBundle,
        *,
        top_k: int = DEFAULT_TOP_K,
        limits: DecodeLimits = DecodeLimits(),
        decode_threads: int | None = None,
        threads: int = 1,
        streams: int = DEFAULT_STREAMS,
        max_batch: int = DEFAULT_MAX_BATCH,
        more: Sequence[ModelBundle] = (),
    ):
        if streams < 1:
            raise ConfigError(f"streams must be at least 1, got {streams}")
        self.streams = streams
        self._runtimes: list[_Runtime] = []  # filled by _open_runtime, which the base class calls per model
        super().__init__(bundle, top_k=top_k, limits=limits, decode_threads=decode_threads, intra_op_threads=threads,
                         max_batch=max_batch, more=more)

    def _open_runtime(self, bundle: ModelBundle, threads: int | None) -> Callable[[np.ndarray], np.ndarray]:
        try:
            import openvino as ov
        except ImportError:
            raise ConfigError(MISSING_OPENVINO) from None

        config = {
            "NUM_STREAMS": self.streams,
            "INFERENCE_NUM_THREADS": (threads or 1) * self.streams,
            # OpenVINO runs FP32 networks in bf16 on CPUs that have it unless told not to; parity needs f32.
            "INFERENCE_PRECISION_HINT": "f32",
            # Each actor's process would pin its streams to the same first cores; the OS spreads them instead.
            "ENABLE_CPU_PINNING": False,
        }
        try:
            core = ov.Core()
            graph = runtime_graph(bundle)  # a path, or the graph with the embedding's tensor as an output
            compiled = core.compile_model(core.read_model(model=graph) if isinstance(graph, bytes) else graph, "CPU",
                                          config)
            outputs = [compiled.output(name) for name in network_outputs(bundle)]
        except Exception as e:  # OpenVINO raises RuntimeError for most things, its own types for some
            raise EngineError(f"OpenVINO cannot load {bundle.onnx_path}: {_one_line(e)}; check the file with "
                              "onnx.checker, or use --engine onnx") from None
        runtime = _Runtime(core, compiled, outputs, bundle.input_name)
        self._runtimes.append(runtime)
        return runtime

    def close(self) -> None:
        """Stops the decode threads, then lets go of OpenVINO's requests, compiled models and core while the
        interpreter still runs: left to its shutdown, with the threads that made the requests still alive (a Ray
        actor's), their release crashed the process (SIGSEGV) at every actor's exit."""
        super().close()
        for runtime in self._runtimes:
            runtime.close()


class _Runtime:
    """One compiled network as a function of a batch, safe to call from several threads at once: one infer request per
    calling thread (a request runs one batch at a time; the streams run them at once), kept here so ``close`` can
    release them all."""

    def __init__(self, core: Any, compiled: Any, outputs: list, input_name: str):
        self._core, self._compiled, self._outputs, self._input_name = core, compiled, outputs, input_name
        self._requests: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        key = threading.get_ident()
        request = self._requests.get(key)
        if request is None:
            with self._lock:
                if self._compiled is None:
                    raise EngineError("the openvino engine was closed; make a new one")
                request = self._requests[key] = self._compiled.create_infer_request()
        # A copy: the request's output tensor is overwritten by its next run.
        answer = request.infer({self._input_name: batch})
        if len(self._outputs) == 1:
            return np.array(answer[self._outputs[0]])
        return np.concatenate([np.asarray(answer[o]).reshape(len(batch), -1) for o in self._outputs], axis=1)

    def close(self) -> None:
        with self._lock:
            self._requests.clear()
            self._outputs = []
            self._compiled = self._core = None


def _one_line(error: Exception) -> str:
    """OpenVINO's message without the "Exception from src/...:N:" lines it stacks above it."""
    lines = [line.strip() for line in str(error).splitlines()]
    return " ".join(line for line in lines if line and not line.startswith("Exception from ")) or type(error).__name__
