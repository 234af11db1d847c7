"""The Triton engine (``--engine triton``): ``TritonClient`` (``pipeline.triton.client``) as an engine, its answers
as ``Result`` rows.

The client sends the encoded images over gRPC to a local tritonserver, which decodes and classifies them (python
backend or DALI); a bad input costs one error row, a server that died is restarted, and every answer is checked
against its request. This module is the engine's registry entry and the adapter to the engine contract.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

from pipeline.engines.base import EngineSpec, Option, Result, positive_float, positive_int, results_from_topk
from pipeline.gpu.defaults import NO_INT8
from pipeline.schema import STAGE_INFER
from pipeline.triton.client import TritonClient
from pipeline.triton.profiles import AUTO, PROFILES
from pipeline.triton.server import STARTUP_TIMEOUT_S

SPEC = EngineSpec(
    name="triton",
    factory=f"{__name__}:TritonEngine",
    summary="one local tritonserver per GPU (gpu profile: DALI + the network) or per actor (portable: "
            "ONNX Runtime on the CPU), images over gRPC",
    options=(
        Option("profile", str, f"the repository the engine builds and serves: {AUTO} (gpu where the actor has a GPU, "
               f"else portable), {' or '.join(sorted(PROFILES))}", choices=(AUTO, *sorted(PROFILES))),
        Option("repository", str, "a folder built by 'bulk-classify repo build'", folder=True),
        Option("url", str, "a running server's gRPC host:port"),
        positive_int("instances", "model instances when the engine builds the repository, e.g. 6"),
        Option("half", bool, "gpu profile, a repository the engine builds: FP16 networks, true or false (default: FP16 "
               "where the precision gate passes)"),
        Option("mps", bool, "a private CUDA MPS daemon for the server the engine starts on a GPU: true "
               "or false (default: the profile's)"),
        positive_float("startup_timeout_s", f"seconds to wait for the server (default {STARTUP_TIMEOUT_S:g})"),
        positive_int("request_batch", "images per request, e.g. 32"),
        positive_int("concurrency", "requests in flight, e.g. 2"),
        Option("server_args", list, "extra tritonserver arguments, e.g. '--log-verbose=1'"),
        Option("model_name", str, "the model to call, e.g. classifier"),
        positive_float("request_timeout_s", "seconds one request may take, e.g. 300"),
        Option("share_server", bool, "one local server for the actors of a GPU (with --num-gpus-per-actor "
               "below 1): true or false"),
    ),
    needs_gpu=True,
    preflight="pipeline.triton.client_checks:check_requirements",
    model_check="pipeline.triton.client_checks:check_model",
    # Two calls per actor: the next batch is sent while this one's last requests finish. The actors of a GPU
    # share its one server (the gpu profile's share_server), so the client work spreads over their processes;
    # a call's images fill the gpu profile's requests in flight (docs/performance.md).
    calls_per_actor=2,
    actors_per_gpu=3,
    gpu_batch_size=2048,
    # Ray kills a worker's child processes when the worker exits, before its atexit handlers run: a GPU's
    # shared server's owner must keep serving the other actors of its GPU until they leave (sharing.py).
    # The server still dies with its owner's launcher thread (PR_SET_PDEATHSIG, server.py). An actor's own
    # server (the portable profile) keeps Ray's default, which stops it before the job's end.
    actor_env={"RAY_kill_child_processes_on_worker_exit": "0"},
    int8=f"INT8 models: with the portable profile (ONNX Runtime); the gpu profile has {NO_INT8}",
    node_start="pipeline.triton.client:start_node_servers",
    # Both served profiles serve a model set as one model (pipeline.triton.contract); a repository of the user's must
    # declare the set's outputs.
    several_models=True,
    models_check="pipeline.triton.client_checks:check_models",
)


class TritonEngine(TritonClient):
    """The ``triton`` engine: ``TritonClient`` (its arguments, defaults and ``events``), one ``Result`` per image."""

    name = "triton"

    @functools.cached_property
    def stage_seconds(self) -> dict[str, float]:
        """The server decodes and classifies: the actor sees one stage, the request's wall time."""
        return {STAGE_INFER: 0.0}

    def classify(self, images: Sequence[bytes]) -> list[Result]:
        """One Result per input, in order; bad inputs are error rows; a model set's other models in ``Result.more``."""
        start = time.perf_counter()
        try:
            answers = self.answers(images)
        finally:
            self.stage_seconds[STAGE_INFER] += time.perf_counter() - start
        sizes, errors = [(a.width, a.height) for a in answers], [a.error for a in answers]
        results = _results([(a.class_ids, a.scores, a.embedding) for a in answers], self.bundle, sizes, errors)
        for index, bundle in enumerate(self.more):
            theirs = _results([a.more[index] if a.more else ((), (), None) for a in answers], bundle, sizes, errors)
            for answer, result, their in zip(answers, results, theirs):
                if not answer.error:  # an image that failed is every model's error, in the Result itself
                    result.more.append(their)
        return results


def _results(tops, bundle, sizes, errors) -> list[Result]:
    """One model's rows of (class ids, scores, embedding or None) per image; an error row has no embedding."""
    results = results_from_topk([t[0] for t in tops], [t[1] for t in tops], bundle.labels, sizes, errors)
    for result, (_, _, vector) in zip(results, tops):
        if vector is not None and result.error is None:
            result.embedding = vector
    return results
