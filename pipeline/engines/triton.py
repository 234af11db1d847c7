"""The Triton engine (``--engine triton``): encoded images over gRPC to a local tritonserver, top-k back.

The server decodes (python backend or DALI), so the actor only checks byte/pixel caps on headers and pads the
files into one UINT8 tensor with their lengths (pipeline.triton.contract). A request that fails because of one
input is split until that input stands alone, so a bad image costs one error row, not a batch; a server that
died is restarted (when this engine owns it) and the request retried.

Every answer is checked: each image goes with a TAG (its request's id and its index) that the model echoes in
ECHO, and a response whose echoes are not exactly the request's tags is retried, then given up as engine_error
rows, never read as those images' labels. A repository without TAG/ECHO is refused (rebuild it). A server that is
slow but alive is waited for, never replaced: only a dead (or hung for HUNG_AFTER_S) server is restarted.
"""

from __future__ import annotations

import io
import itertools
import logging
import re
import secrets
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

from pipeline.engines.base import EngineSpec, Option, Result, positive_float, positive_int, results_from_topk
from pipeline.engines.triton_wire import AnswerMismatch, check_answer, encode_request, parse_response, plan_requests
from pipeline.errors import ERROR_KINDS, ConfigError, EngineError, ImageError, ModelError, TritonError
from pipeline.model.imaging import DecodeLimits, decode_image, follow_pixel_cap
from pipeline.schema import STAGE_INFER
from pipeline.triton import contract as tn
from pipeline.triton.profiles import AUTO, GPU, PORTABLE, PROFILES, choose_profile, visible_gpus
from pipeline.triton.server import HEALTH_TIMEOUT_S, STARTUP_TIMEOUT_S, find_tritonserver
from pipeline.triton.workdirs import REPOSITORY_PREFIX, sweep_dead_owner_folders

LOG = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 300.0
# A request that brings the server down again right after a restart is poison: its inputs are then sent one by
# one, so only the culprit costs a restart and an error row.
MAX_RESTARTS_PER_REQUEST = 1
# What Triton answers, with the server still "ready", once a python-backend stub has died (a crashing decoder).
STUB_DEAD_MARKER = "is not healthy"
EXTERNAL_RETRY_S = (1.0, 2.0, 4.0)
# The owner of a shared server checks its process this often, between its own requests too: the server's other
# users wait for the owner to restart it, and an owner with no batch in flight would leave them waiting.
WATCH_S = 1.0
# gRPC status codes that mean "the server is gone or not answering", not "this request is bad". A request past
# its deadline (DEADLINE_EXCEEDED) met a slow server: it is sent again, never counted as the server's death.
SERVER_DOWN_CODES = ("UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL")
TIMEOUT_CODE = "DEADLINE_EXCEEDED"
# A response answering other images than its request's is sent again this many times before its images become
# engine_error rows.
MAX_MISMATCH_RETRIES = 2
# The engine's counters (``TritonEngine.events``, summed into the run report's ``engine_events``).
EVENT_REQUESTS = "requests"  # requests sent, retries included
EVENT_CHECKED = "answers_checked"  # images whose answer's ECHO was their own TAG
EVENT_MISMATCHES = "answer_mismatches"  # responses whose ECHO named other images (each one retried)
EVENT_TIMEOUTS = "request_timeouts"  # requests without an answer within request_timeout_s (each one retried)
EVENT_STARTS = "server_starts"  # tritonservers this engine started (a shared one counts for its owner only)
EVENT_RESTARTS = "server_restarts"  # restarts of a server this engine owns
EVENT_FAILOVERS = "server_failovers"  # moves of a shared-server user to another server (restarted, or its own)
EVENTS = (EVENT_REQUESTS, EVENT_CHECKED, EVENT_MISMATCHES, EVENT_TIMEOUTS, EVENT_STARTS, EVENT_RESTARTS,
          EVENT_FAILOVERS)

SPEC = EngineSpec(
    name="triton",
    factory=f"{__name__}:TritonEngine",
    summary="one local tritonserver per GPU (gpu profile: DALI + the network) or per actor (portable: "
            "ONNX Runtime on the CPU), images over gRPC",
    options=(
        Option("profile", str, f"the repository the engine builds and serves: {AUTO} (gpu where the actor has a GPU, "
               f"else portable), {' or '.join(sorted(PROFILES))}", choices=(AUTO, *sorted(PROFILES))),
        Option("repository", str, "a folder built by 'bulk-classify repo build'"),
        Option("url", str, "a running server's gRPC host:port"),
        positive_int("instances", "model instances when the engine builds the repository, e.g. 6"),
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
    preflight=f"{__name__}:check_requirements",
    model_check=f"{__name__}:check_model",
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
    int8=f"INT8 models: with the portable profile (ONNX Runtime); the gpu profile has {tn.NO_INT8}",
    node_start=f"{__name__}:start_node_servers",
)


class _ServerDown(Exception):
    """The server stopped answering while serving these inputs (restarts did not help)."""


class _NoAnswer(Exception):
    """These inputs got no answer of their own after the retries (timeouts, mismatched answers, a shared server
    that stays unreachable): each becomes an engine_error row."""


def _check_caps(data: bytes, limits: DecodeLimits, pixels: bool = True) -> None:
    """Raises the reference's own ImageError for empty, too large, or (``pixels``) too many pixels by the header.

    decode_image raises those before decoding any pixel, so calling it only when a cap is exceeded costs
    nothing and gives the exact error text of ``--engine onnx``. The pixel check opens the header with Pillow
    (a cost on every file): skipped for a model that checks the caps itself (``checks_caps``).
    """
    if len(data) == 0 or len(data) > limits.max_bytes:
        decode_image(data, limits)
    if not pixels:
        return
    from PIL import Image  # noqa: PLC0415

    follow_pixel_cap(limits.max_pixels)
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Image.DecompressionBombError:
        decode_image(data, limits)
        return
    except Exception:  # noqa: BLE001 - not readable here: the server reports the precise error for this input
        return
    if width * height > limits.max_pixels:
        decode_image(data, limits)


def _serialized(request) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


# Triton puts this before a composing model's error (the gpu profile's ensemble shape): the kind follows it.
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")


def _error_text(reason: str) -> str:
    """The error row of an input whose one-image request failed: the server's "kind: detail" when it gives one
    (python-backend profiles without the ERROR output), else decode_error/engine_error with its message."""
    reason = _ENSEMBLE_PREFIX.sub("", reason, count=1)
    kind = reason.split(":", 1)[0].strip()
    if kind in ERROR_KINDS and ":" in reason:
        return reason[:1000]
    kind = "decode_error" if "decod" in reason.lower() else "engine_error"
    return str(ImageError(kind, f"server: {reason[:500]}"))


class TritonEngine:
    """Classifies through a tritonserver that serves pipeline.triton.contract' contract (any profile).

    Args:
        bundle: the model (labels, and the ONNX/spec the default repository is built from).
        top_k: classes per image; at most the repository's k.
        limits: byte and pixel caps, checked here before sending, and sent to the server with each request.
        profile: the repository profile this engine builds and serves (pipeline.triton.profiles): "auto" is the
            gpu profile where this process has a GPU, else the portable one. Its ``ServingProfile`` gives every
            default below that is None.
        repository: a model repository folder; default: ``profile``'s for ``bundle``, built once into the cache
            (pipeline.triton.repository.cached_repository).
        url: "host:port" of an already running server's gRPC endpoint (then no server is started or restarted).
        instances: model instances when this engine builds the repository.
        mps: start a private CUDA MPS daemon for the server this engine starts (pipeline.triton.mps).
        startup_timeout_s: how long to wait for the server to be ready.
        request_batch: images per request at most.
        concurrency: requests in flight at once.
        server_args: extra tritonserver arguments (after the profile's own).
        model_name: the model to call (default pipeline.triton.contract.MODEL_NAME).
        request_timeout_s: how long one request may take before it counts as failed.
        share_server: share one local server between the engines of this node that would start the same one on
            the same GPU (several actors per GPU; pipeline.triton.sharing); ignored with ``url``.
        gpus: the GPU(s) of the server this engine starts, as CUDA_VISIBLE_DEVICES names them (default: this
            process's; the driver gives each of its node's GPUs, ``start_node_servers``).
    """

    name = "triton"

    def __init__(
        self,
        bundle,
        *,
        top_k: int = tn.DEFAULT_TOP_K,
        limits: DecodeLimits = DecodeLimits(),
        profile: str = AUTO,
        repository: str | None = None,
        url: str | None = None,
        instances: int | None = None,
        mps: bool | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        request_batch: int | None = None,
        concurrency: int | None = None,
        server_args: Sequence[str] = (),
        model_name: str = tn.MODEL_NAME,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        share_server: bool | None = None,
        gpus: str | None = None,
    ):
        self.profile = serving = choose_profile(profile)
        self.gpus = gpus
        request_batch = serving.request_batch if request_batch is None else request_batch
        concurrency = serving.concurrency if concurrency is None else concurrency
        share_server = serving.share_server if share_server is None else share_server
        self.use_mps = serving.mps if mps is None else mps
        if top_k < 1 or request_batch < 1 or concurrency < 1:
            raise ConfigError(f"top_k={top_k}, request_batch={request_batch} and concurrency={concurrency} "
                              "must be positive")
        self.bundle = bundle
        self.top_k = top_k
        self.limits = limits
        self.request_batch = request_batch
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.server = None
        self.events = dict.fromkeys(EVENTS, 0)
        self._events_lock = threading.Lock()
        # Request ids start at random so two engines sharing a server never send the same TAG.
        self._request_ids = itertools.count(secrets.randbits(32))
        self._lease = None  # pipeline.triton.sharing.ServerLease when the server is shared
        # The server decodes and classifies: the actor sees one stage, the request's wall time.
        self.stage_seconds = {STAGE_INFER: 0.0}
        self._mps = None  # pipeline.triton.mps.MpsDaemon of the server this engine owns
        self._local = threading.local()
        self._generation = 0
        self._restart_lock = threading.Lock()
        # Held while inputs that brought the server down are retried one at a time: no other request is sent
        # meanwhile, so a crash is blamed on the one input in flight and not on its neighbours.
        self._quarantine = threading.RLock()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="triton-request")
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._share = share_server and not url
        try:
            if url:
                self.url = url
                self._wait_external(startup_timeout_s)
            else:
                self._start_own(bundle, repository, instances, startup_timeout_s,
                                [*serving.server_args(), *server_args])
            self._read_model()
        except BaseException:
            self.close()
            raise

    # ---- setup ---------------------------------------------------------------------------------------------

    def _start_own(self, bundle, repository, instances, startup_timeout_s, server_args) -> None:
        from pipeline.triton.checks import preflight  # noqa: PLC0415
        from pipeline.triton.repository_cache import cached_repository  # noqa: PLC0415
        from pipeline.triton.server import TritonServer  # noqa: PLC0415

        if repository is None:
            sweep_dead_owner_folders(REPOSITORY_PREFIX)
            repository = str(cached_repository(self.profile, bundle, top_k=max(self.top_k, tn.DEFAULT_TOP_K),
                                               instances=instances))
        preflight(repository)

        def start():
            env = self._start_mps()
            if self.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = self.gpus
            try:
                server = TritonServer(repository, startup_timeout_s=startup_timeout_s, extra_args=server_args,
                                      env=env).start()
            except BaseException:
                self._stop_mps()
                raise
            return server

        if not self._share:
            self.server = start()
            self.url = self.server.grpc_url
            self._count(EVENT_STARTS)
            return
        from pipeline.triton.sharing import ServerLease, lease_key  # noqa: PLC0415

        self._lease = ServerLease(lease_key(repository, server_args, self.model_name, self.gpus))
        self._start = start
        self.url, self.server = self._lease.acquire(start)
        self._lease.join()
        if self.server is None:
            self._wait_external(startup_timeout_s)
        else:
            self._count(EVENT_STARTS)
            self._watch()

    def _start_mps(self) -> dict[str, str]:
        """The environment of a server under this engine's private MPS daemon; {} without one (a message says why
        where MPS was wanted but cannot start)."""
        if not self.use_mps or not self.profile.needs_gpu or self._mps is not None:
            return dict(self._mps.env) if self._mps is not None else {}
        from pipeline.triton.mps import CONTROL, MpsDaemon  # noqa: PLC0415

        daemon = MpsDaemon(gpus=self.gpus)
        if not daemon.available:
            LOG.warning("%s is not on this node: the server's model instances take turns on the GPU (slower); "
                        "install the NVIDIA driver's utilities, or pass --engine-option mps=false", CONTROL)
            self.use_mps = False
            return {}
        try:
            env = daemon.start()
        except (OSError, subprocess.SubprocessError) as err:
            LOG.warning("a private CUDA MPS daemon did not start (%s): serving without MPS (slower); "
                        "pass --engine-option mps=false to skip it", err)
            self.use_mps = False
            return {}
        self._mps = daemon
        return env

    def _stop_mps(self) -> None:
        if self._mps is not None:
            self._mps.stop()
            self._mps = None

    def _take_lease_again(self, failed: str) -> None:
        """Our shared server (at ``failed``) stopped answering: find its restarted successor, or start one and
        own it (``ServerLease.acquire``: never while its process lives). Nothing to do when another thread
        already moved on from ``failed``."""
        with self._restart_lock:
            if self.url != failed:
                return
            url, server = self._lease.acquire(self._start, exclude_url=failed, wait_s=self.startup_timeout_s)
            if url == failed:
                LOG.info("shared tritonserver %s is slow to answer but alive; still sharing it", failed)
                return
            self.url, self.server = url, server
            self._generation += 1
            self._count(EVENT_FAILOVERS)
            if self.server is None:
                self._wait_external(self.startup_timeout_s)
            else:
                self._count(EVENT_STARTS)
                self._watch()
            LOG.warning("shared tritonserver %s stopped answering; now %s (%s)", failed, self.url,
                        "ours" if self.server is not None else "shared")

    def _count(self, event: str, n: int = 1) -> None:
        with self._events_lock:
            self.events[event] += n

    def _wait_external(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                if self._client().is_model_ready(self.model_name, client_timeout=HEALTH_TIMEOUT_S):
                    return
            except Exception as err:  # noqa: BLE001 - keep polling until the deadline
                last = err
            time.sleep(0.5)
        raise TritonError(f"model {self.model_name!r} at {self.url} not ready after {timeout_s:.0f} s ({last}); "
                          "start the server first or drop --engine-option url=... to let each actor start its own")

    def _read_model(self) -> None:
        config = self._client().get_model_config(self.model_name, as_json=True)["config"]
        outputs = {o["name"]: o for o in config.get("output", [])}
        missing = [name for name in tn.REQUIRED_OUTPUTS if name not in outputs]
        missing += [name for name in tn.INPUTS if name not in {i["name"] for i in config.get("input", [])}]
        if missing:
            raise TritonError(f"model {self.model_name!r} at {self.url} lacks {', '.join(missing)} (answers "
                              "cannot be checked); serve a repository built by `bulk-classify repo build`")
        self.repository_k = int(outputs[tn.OUTPUT_SCORES]["dims"][0])
        self.has_error_output = tn.OUTPUT_ERROR in outputs
        params = config.get("parameters", {})
        self.server_checks_caps = params.get(tn.PARAM_CHECKS_CAPS, {}).get("string_value", "") == "true"
        self._wanted = [*tn.REQUIRED_OUTPUTS] + ([tn.OUTPUT_ERROR] if self.has_error_output else [])
        if self.top_k > self.repository_k:
            raise ConfigError(f"top_k={self.top_k} but the repository returns {self.repository_k} classes per image; "
                              f"lower top_k or rebuild the repository with top_k >= {self.top_k}")

    def _client(self):
        """One gRPC client per thread and per server generation (a restarted server has new ports)."""
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        if getattr(self._local, "generation", None) != self._generation or getattr(self._local, "url", None) != self.url:
            self._local.client = grpcclient.InferenceServerClient(self.url)
            self._local.generation = self._generation
            self._local.url = self.url
        return self._local.client

    # ---- classify ------------------------------------------------------------------------------------------

    def classify(self, images: Sequence[bytes]) -> list[Result]:
        """One Result per input, in order; bad inputs are error rows."""
        start = time.perf_counter()
        try:
            return self._classify(images)
        finally:
            self.stage_seconds[STAGE_INFER] += time.perf_counter() - start

    def _classify(self, images: Sequence[bytes]) -> list[Result]:
        self._health_check()
        results: list[Result | None] = [None] * len(images)
        to_send: list[int] = []
        for i, data in enumerate(images):
            try:
                _check_caps(data, self.limits, pixels=not self.server_checks_caps)
                to_send.append(i)
            except ImageError as err:
                results[i] = Result.failed(str(err))
        groups = plan_requests([len(images[i]) for i in to_send], self.request_batch)
        futures = [self._pool.submit(self._isolating, [to_send[j] for j in group], images) for group in groups]
        for future in futures:
            for index, result in future.result():
                results[index] = result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _health_check(self) -> None:
        """Between batches: restart our server if it died or stopped answering."""
        if self.server is not None:
            with self._restart_lock:
                if self.server.ensure_running():
                    self._after_restart()

    def _watch(self) -> None:
        """Starts the thread that restarts our shared server as soon as its process dies (once per engine)."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch_loop, name="tritonserver-watchdog", daemon=True)
            self._watchdog.start()

    def _watch_loop(self) -> None:
        while not self._closing.wait(WATCH_S):
            server = self.server
            if server is None or server.is_alive():
                continue
            try:
                with self._restart_lock:
                    if self.server is server and not self._closing.is_set() and server.ensure_running():
                        self._after_restart()
            except Exception as err:  # noqa: BLE001 - the next request's own restart path reports it
                LOG.warning("tritonserver watchdog: restarting the shared server failed (%s)", err)

    def _after_restart(self) -> None:
        self.url = self.server.grpc_url
        if self._lease is not None:
            self._lease.publish(self.server)
        self._generation += 1
        self._count(EVENT_RESTARTS)
        LOG.warning("tritonserver restarted (restart #%d); now at %s", self.server.restarts, self.url)

    def _isolating(self, indices: list[int], images: Sequence[bytes]) -> list[tuple[int, Result]]:
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        try:
            return list(zip(indices, self._infer([images[i] for i in indices])))
        except InferenceServerException as err:
            reason = (err.message() or str(err)).strip()
            if len(indices) == 1:
                return [(indices[0], Result.failed(_error_text(reason)))]
            LOG.info("request of %d images failed (%s); splitting it to isolate the input", len(indices), reason[:200])
        except _NoAnswer as err:
            return [(i, Result.failed(str(ImageError("engine_error", str(err))))) for i in indices]
        except _ServerDown as err:
            if self._in_quarantine() and len(indices) == 1:
                return [(indices[0], Result.failed(str(ImageError("engine_error", str(err)))))]
            LOG.warning("a request of %d images brought the server down twice; sending them one at a time, alone",
                        len(indices))
            with self._quarantine:
                self._local.quarantined = True
                try:
                    return [pair for i in indices for pair in self._isolating([i], images)]
                finally:
                    self._local.quarantined = False
        half = len(indices) // 2
        return self._isolating(indices[:half], images) + self._isolating(indices[half:], images)

    def _in_quarantine(self) -> bool:
        return getattr(self._local, "quarantined", False)

    def _model_infer(self):
        """ModelInfer on this thread's gRPC channel (per server generation), taking requests already serialized
        (``triton_wire.encode_request``: the files copied once) or protobuf messages."""
        import grpc  # noqa: PLC0415
        from tritonclient.grpc import service_pb2  # noqa: PLC0415

        local = self._local
        if getattr(local, "stub_key", None) != (self._generation, self.url):
            options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            local.channel = channel = grpc.insecure_channel(self.url, options=options)
            local.model_infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer", request_serializer=_serialized,
                response_deserializer=service_pb2.ModelInferResponse.FromString)
            local.stub_key = (self._generation, self.url)
        return local.model_infer

    def _request(self, blobs: list[bytes], tags) -> bytes:
        return encode_request(self.model_name, blobs, self._wanted, self.limits, tags)

    def _infer(self, blobs: list[bytes]) -> list[Result]:
        """One request, its answer checked; restarts a dead server and retries, sends a timed-out or mismatched
        request again. Raises InferenceServerException for a bad request, _NoAnswer when retries ran out."""
        import grpc  # noqa: PLC0415
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        retries = list(EXTERNAL_RETRY_S)
        restarts = failovers = mismatches = timeouts = 0
        while True:
            with self._quarantine:  # wait while another thread isolates a crashing input
                generation, url = self._generation, self.url
            tags = tn.tags(next(self._request_ids), len(blobs))  # a new id per try: no answer to an older one fits
            self._count(EVENT_REQUESTS)
            try:
                try:
                    response = self._model_infer()(self._request(blobs, tags), timeout=self.request_timeout_s)
                except grpc.RpcError as rpc:
                    raise InferenceServerException(msg=rpc.details(), status=str(rpc.code())) from None
                return self._checked(response, tags)
            except AnswerMismatch as err:
                mismatches += 1
                self._count(EVENT_MISMATCHES)
                LOG.warning("tritonserver %s answered a request of %d images for other images (%s); sending it "
                            "again", url, len(blobs), err)
                if mismatches > MAX_MISMATCH_RETRIES:
                    raise _NoAnswer(f"tritonserver answered {mismatches} times for other images ({err})") from None
            except InferenceServerException as err:
                if TIMEOUT_CODE in str(err.status() or ""):
                    timeouts += 1
                    self._count(EVENT_TIMEOUTS)
                    if timeouts > len(EXTERNAL_RETRY_S):
                        raise _NoAnswer(f"no answer within request_timeout_s={self.request_timeout_s:g} s, "
                                        f"{timeouts} times; raise request_timeout_s or lower request_batch") from None
                    continue  # the server is slow, not gone: the request has waited its timeout already
                if (self._generation, self.url) != (generation, url):
                    continue  # the server was restarted on new ports while this request was out: send it there
                stub_dead = STUB_DEAD_MARKER in (err.message() or str(err))
                if not (stub_dead or self._server_down(err)):
                    raise
                if self.server is None:
                    if stub_dead and self._lease is None:
                        raise  # not ours to restart: each input of the request becomes an error row
                    if not retries and self._lease is not None and failovers < MAX_RESTARTS_PER_REQUEST + 1:
                        self._take_lease_again(url)
                        retries, failovers = list(EXTERNAL_RETRY_S), failovers + 1
                        continue
                    if not retries and self._lease is not None:
                        raise _NoAnswer(f"the shared tritonserver at {self.url} stopped answering ({err})") from None
                    if not retries:
                        raise EngineError(f"tritonserver at {self.url} stopped answering ({err}); check that it "
                                          "is running, or let the engine start its own (no url)") from None
                    time.sleep(retries.pop(0))
                    continue
                with self._restart_lock:
                    if self._generation == generation:  # else another request's thread restarted it already
                        if stub_dead:
                            self.server.restart()
                            self._after_restart()
                        elif self.server.ensure_running():
                            self._after_restart()
                    moved = self._generation != generation
                if not moved:  # alive and answering its health check: this request failed in passing
                    if not retries:
                        raise _NoAnswer(f"tritonserver is up but failed this request {len(EXTERNAL_RETRY_S) + 1} "
                                        f"times (last: {(err.message() or str(err))[:200]})") from None
                    time.sleep(retries.pop(0))
                    continue
                if restarts >= MAX_RESTARTS_PER_REQUEST:
                    raise _ServerDown(f"tritonserver failed {restarts + 1} times serving this input "
                                      f"(last: {(err.message() or str(err))[:200]})") from None
                restarts += 1

    def _checked(self, response, tags) -> list[Result]:
        """The request's results, once every row's ECHO is its own image's TAG; else AnswerMismatch."""
        check_answer(response, tags)
        results = self._results(response, len(tags))
        self._count(EVENT_CHECKED, len(tags))
        return results

    def _server_down(self, err) -> bool:
        """Is this failure the server's (restart/retry) rather than the request's (split)?"""
        status = str(err.status() or "")
        if "INVALID_ARG" in status:
            return False  # the server read the request and refused one of its inputs: it is up
        if self.server is not None:
            if any(code in status for code in ("UNAVAILABLE", "CANCELLED")):
                return True
            # A loaded host can keep a healthy server from answering within a couple of seconds.
            return not self.server.is_ready(HEALTH_TIMEOUT_S)
        if not any(code in status for code in SERVER_DOWN_CODES):
            return False
        try:  # a model's own INTERNAL error on one input comes from a server that is still ready
            return not self._client().is_server_ready(client_timeout=HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer at all: down
            return True

    def _results(self, response, n: int) -> list[Result]:
        ids, scores, widths, heights, texts = parse_response(response, n, self.has_error_output)
        sizes = [(int(widths[i]) or None, int(heights[i]) or None) for i in range(n)]
        return results_from_topk(ids[:, : self.top_k], scores[:, : self.top_k], self.bundle.labels, sizes, texts)

    # ---- close ---------------------------------------------------------------------------------------------

    def close(self, *, graceful: bool = True, linger_s: float | None = None) -> None:
        """Stops the server this engine started (a shared one once its other users have left, up to ``linger_s``,
        default sharing.LINGER_S) and its MPS daemon; ``graceful=False`` kills it instead of letting its
        instances unload (seconds each), for a server whose work is done."""
        closing, watchdog = getattr(self, "_closing", None), getattr(self, "_watchdog", None)
        if closing is not None:
            closing.set()
        if watchdog is not None:
            watchdog.join(self.startup_timeout_s)
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        lease = getattr(self, "_lease", None)
        if self.server is not None:
            if lease is not None:
                lease.release(self.server, **({} if linger_s is None else {"linger_s": linger_s}))
            self.server.stop(graceful=graceful)
            self.server = None
        elif lease is not None:
            lease.leave()
        self._stop_mps()

    def __enter__(self) -> "TritonEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NodeServers:
    """The shared servers of the driver's node, started by the driver while Ray starts (``start_node_servers``).

    A server's start (its instances building their classifiers) is the longest part of a job's start; begun in the
    driver it runs beside Ray's start and the actors' own, and the actors find it through the lease as they would
    another actor's. The driver owns it for the whole job, so no actor's end stops it early.
    """

    def __init__(self, bundle, *, top_k: int, limits: DecodeLimits, options: Mapping[str, Any],
                 gpus: Sequence[str | None]):
        self.engines: list[TritonEngine] = []  # every one started (their events stay readable after close)
        self._lock = threading.Lock()
        self._stopper: threading.Thread | None = None
        self._threads = [threading.Thread(target=self._start, args=(bundle, top_k, limits, options, gpu),
                                          name=f"tritonserver-start-{gpu or 'node'}", daemon=True) for gpu in gpus]
        for thread in self._threads:
            thread.start()

    def _start(self, bundle, top_k, limits, options, gpu: str | None) -> None:
        try:
            engine = TritonEngine(bundle, top_k=top_k, limits=limits, gpus=gpu, **options)
        except Exception as err:  # noqa: BLE001 - the actors start their own; the job goes on
            LOG.warning("the driver could not start the tritonserver of GPU %s ahead of the actors (%s); they "
                        "start their own", gpu or "(none)", str(err).splitlines()[0][:300] if str(err) else type(err).__name__)
            return
        with self._lock:
            self.engines.append(engine)
        LOG.info("the driver started the tritonserver %s of GPU %s for this node's actors", engine.url, gpu or "(none)")

    @property
    def events(self) -> dict[str, int]:
        """The servers' counters (starts, restarts), summed."""
        total = dict.fromkeys(EVENTS, 0)
        for engine in self.engines:
            for key, value in engine.events.items():
                total[key] += value
        return total

    def close(self, wait: bool = True) -> None:
        """Once the job is done: stops every server, once, at once (its work is done: the instances need not unload)
        and without waiting for actors that are only exiting; ``wait=False`` leaves that to a background thread."""
        with self._lock:
            if self._stopper is None:
                self._stopper = threading.Thread(target=self._stop, name="tritonserver-stop", daemon=True)
                self._stopper.start()
        if wait:
            self._stopper.join()

    def _stop(self) -> None:
        for thread in self._threads:  # a start still running
            thread.join()
        for engine in self.engines:
            engine.close(graceful=False, linger_s=0.0)


def start_node_servers(bundle, *, top_k: int, limits: DecodeLimits, options: Mapping[str, Any]) -> NodeServers | None:
    """The triton engine's ``EngineSpec.node_start``: in the driver of a local Ray, the shared server of each GPU
    (of the node, without GPUs), started in the background; None where the actors would not share one (``url``,
    ``share_server=false``)."""
    serving = choose_profile(options.get("profile", AUTO))
    if options.get("url") or not options.get("share_server", serving.share_server):
        return None
    from pipeline.triton.profiles import visible_gpus  # noqa: PLC0415

    # Actors without a GPU inherit the driver's CUDA_VISIBLE_DEVICES (Ray sets it only for GPU actors): their key
    # is the driver's own, None.
    return NodeServers(bundle, top_k=top_k, limits=limits, options=options, gpus=visible_gpus() or [None])


def check_requirements(options: Mapping[str, Any]) -> None:
    """The triton engine's preflight (its ``EngineSpec.preflight``): a repository that exists, the gpu profile's
    stack where the actor gets that profile, and a tritonserver unless ``url`` is given."""
    from pipeline.triton.repository import CONFIG_FILE  # noqa: PLC0415 - the layout's names, only to check one

    repository = options.get("repository")
    if repository is not None:
        path = Path(str(repository)).expanduser()
        if not (path / tn.MODEL_NAME / CONFIG_FILE).is_file():
            what = "does not exist" if not path.exists() else f"has no {tn.MODEL_NAME}/{CONFIG_FILE}"
            raise ConfigError(f"--engine-option repository={repository} {what}; build one with "
                              f"'bulk-classify repo build --profile {PORTABLE} --output DIR' and pass that DIR")
    if options.get("url"):
        return
    if repository is None and options.get("profile") == GPU and not visible_gpus():
        raise ConfigError(f"--engine-option profile={GPU} serves DALI and the network on a GPU and this machine has "
                          f"none; use --engine onnx, or --engine-option profile={PORTABLE}")
    if repository is None and choose_profile(options.get("profile", AUTO)).needs_gpu:
        from pipeline.engines.auto import GPU_EXTRA_HINT, missing_gpu_stack  # noqa: PLC0415

        missing = missing_gpu_stack()
        if missing:
            raise ConfigError(f"--engine triton serves the gpu profile on this GPU machine, which needs "
                              f"{' and '.join(missing)}: {GPU_EXTRA_HINT}, or pass --engine-option profile={PORTABLE}")
    try:
        find_tritonserver()
    except TritonError as err:
        raise ConfigError(f"--engine triton: {err}") from None


def check_model(bundle, options: Mapping[str, Any]) -> None:
    """The triton engine's ``EngineSpec.model_check``, in the driver: where its actors will serve the gpu profile
    from a repository built for the model, the gpu paths must be able to run it."""
    if options.get("url") or options.get("repository") is not None:
        return  # a server or repository of the user's: its model is checked where it was built
    from pipeline.engines.auto import cluster_gpus  # noqa: PLC0415 - ray, only with RAY_ADDRESS

    profile = options.get("profile", AUTO)
    gpus, where = cluster_gpus()
    if profile == AUTO:
        profile = GPU if gpus > 0 else PORTABLE
    elif profile == GPU and gpus <= 0:  # on a cluster too, where the preflight is skipped
        raise ConfigError(f"--engine-option profile={GPU} serves DALI and the network on a GPU and {where} has none; "
                          f"use --engine onnx, or --engine-option profile={PORTABLE}")
    if profile == GPU:
        from pipeline.gpu.networks import check_runnable  # noqa: PLC0415 - cheap: torch loads inside
        from pipeline.model.folder import PRECISION_INT8  # noqa: PLC0415

        if bundle.precision == PRECISION_INT8:
            raise ModelError(f"model {bundle.name!r} is INT8 and the triton engine's gpu profile has {tn.NO_INT8}; "
                             f"pass --engine-option profile={PORTABLE}, or the FP32 model")
        check_runnable(bundle, "--engine triton with the gpu profile")
