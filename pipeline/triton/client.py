"""The Triton client the triton engine runs: encoded images over gRPC to a local tritonserver, top-k back.

The server decodes (python backend or DALI), so the actor only checks byte/pixel caps on headers and pads the
files into one UINT8 tensor with their lengths (pipeline.triton.contract). A request that fails because of one
input is split until that input stands alone, so a bad image costs one error row, not a batch; a server that
died is restarted (when this engine owns it) and the request retried.

Every answer is checked: each image goes with a TAG (its request's id and its index) that the model echoes in
ECHO, and a response whose echoes are not exactly the request's tags is retried, then given up as engine_error
rows, never read as those images' labels. A repository without TAG/ECHO is refused (rebuild it). A server that is
slow but alive is waited for, never replaced: only a dead (or hung for HUNG_AFTER_S) server is restarted.

This module is the client (requests, retries, isolating bad inputs) and the driver's start of its node's shared
servers (``NodeServers``); the server it talks to is supervised by ``pipeline.triton.supervisor``, its preflight and
input checks are ``pipeline.triton.client_checks``, its requests are encoded by ``pipeline.triton.wire``. The engine
(``pipeline.engines.triton``) turns its answers into rows.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


from pipeline.errors import ConfigError, EngineError, ImageError, TritonError
from pipeline.model.imaging import DecodeLimits
from pipeline.schema import DEFAULT_TOP_K
from pipeline.triton import contract as tn
from pipeline.triton.client_checks import check_caps, error_text
from pipeline.triton.profiles import AUTO, choose_profile, visible_gpus
from pipeline.triton.server import HEALTH_TIMEOUT_S, STARTUP_TIMEOUT_S
from pipeline.triton.supervisor import EVENT_FAILOVERS, EVENT_RESTARTS, EVENT_STARTS, ServerSupervisor
from pipeline.triton.wire import AnswerMismatch, check_answer, encode_request, parse_response, plan_requests

LOG = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 300.0
# A request that brings the server down again right after a restart is poison: its inputs are then sent one by
# one, so only the culprit costs a restart and an error row.
MAX_RESTARTS_PER_REQUEST = 1
# What Triton answers, with the server still "ready", once a python-backend stub has died (a crashing decoder).
STUB_DEAD_MARKER = "is not healthy"
EXTERNAL_RETRY_S = (1.0, 2.0, 4.0)
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
# and the supervision's: EVENT_STARTS, EVENT_RESTARTS, EVENT_FAILOVERS (pipeline.triton.supervisor)
EVENTS = (EVENT_REQUESTS, EVENT_CHECKED, EVENT_MISMATCHES, EVENT_TIMEOUTS, EVENT_STARTS, EVENT_RESTARTS,
          EVENT_FAILOVERS)



@dataclass(frozen=True)
class Answer:
    """One image's answer: its top-k class ids and scores (best first), embedding (where the model has one) and
    decoded size, or its error row's text; ``more``: a model set's other models' (class ids, scores, embedding or
    None), in the set's order (empty with an error)."""

    class_ids: Sequence[int] = ()
    scores: Sequence[float] = ()
    width: int | None = None
    height: int | None = None
    error: str | None = None
    more: Sequence[tuple[Sequence[int], Sequence[float], Sequence[float] | None]] = ()
    embedding: Sequence[float] | None = None


class _ServerDown(Exception):
    """The server stopped answering while serving these inputs (restarts did not help)."""


class _NoAnswer(Exception):
    """These inputs got no answer of their own after the retries (timeouts, mismatched answers, a shared server
    that stays unreachable): each becomes an engine_error row."""


def _serialized(request) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


class TritonClient:
    """Classifies through a tritonserver that serves pipeline.triton.contract' contract (any profile): an ``Answer``
    per image (``answers``).

    Args:
        bundle: the model (labels, and the ONNX/spec the default repository is built from).
        top_k: classes per image (the run's, checked by its config); at most the repository's k.
        limits: byte and pixel caps, checked here before sending, and sent to the server with each request.
        profile: the repository profile this engine builds and serves (pipeline.triton.profiles): "auto" is the
            gpu profile where this process has a GPU, else the portable one. Its ``ServingProfile`` gives every
            default below that is None.
        repository: a model repository folder; default: ``profile``'s for ``bundle``, built once into the cache
            (pipeline.triton.repository.cached_repository).
        url: "host:port" of an already running server's gRPC endpoint (then no server is started or restarted).
        instances: model instances when this engine builds the repository.
        half: the gpu profile's precision when this engine builds the repository: True FP16, False FP32, None the
            precision gate's verdict per network.
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
        more: a model set's other models, served with ``bundle`` as one model that decodes each image once; each
            answers up to ``top_k`` classes, at most its own.
    """

    def __init__(
        self,
        bundle,
        *,
        top_k: int = DEFAULT_TOP_K,
        limits: DecodeLimits = DecodeLimits(),
        profile: str = AUTO,
        repository: str | None = None,
        url: str | None = None,
        instances: int | None = None,
        half: bool | None = None,
        mps: bool | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        request_batch: int | None = None,
        concurrency: int | None = None,
        server_args: Sequence[str] = (),
        model_name: str = tn.MODEL_NAME,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        share_server: bool | None = None,
        gpus: str | None = None,
        more: Sequence[Any] = (),
    ):
        self.profile = serving = choose_profile(profile)
        self.gpus = gpus
        request_batch = serving.request_batch if request_batch is None else request_batch
        concurrency = serving.concurrency if concurrency is None else concurrency
        share_server = serving.share_server if share_server is None else share_server
        if request_batch < 1 or concurrency < 1:
            raise ConfigError(f"request_batch={request_batch} and concurrency={concurrency} must be positive")
        self.bundle = bundle
        self.more = tuple(more)
        self.top_k = top_k
        self.limits = limits
        self.request_batch = request_batch
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.events = dict.fromkeys(EVENTS, 0)
        self._events_lock = threading.Lock()
        # Request ids start at random so two engines sharing a server never send the same TAG.
        self._request_ids = itertools.count(secrets.randbits(32))
        self._local = threading.local()
        self.servers = ServerSupervisor(profile=serving, model_name=model_name, startup_timeout_s=startup_timeout_s,
                                        use_mps=serving.mps if mps is None else mps,
                                        share=bool(share_server and not url), gpus=gpus, count=self._count)
        # Held while inputs that brought the server down are retried one at a time: no other request is sent
        # meanwhile, so a crash is blamed on the one input in flight and not on its neighbours.
        self._quarantine = threading.RLock()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="triton-request")
        try:
            if url:
                self.servers.wait_external(startup_timeout_s, url)
            else:
                self.servers.start_own(bundle, repository, instances, top_k, [*serving.server_args(), *server_args],
                                       more=self.more, half=half)
            self._read_model()
        except BaseException:
            self.close()
            raise

    # ---- setup ---------------------------------------------------------------------------------------------

    # The server as the supervision has it now (it moves on a restart or a failover).
    server = property(lambda self: self.servers.server)
    url = property(lambda self: self.servers.url)
    use_mps = property(lambda self: self.servers.use_mps)
    _lease = property(lambda self: self.servers.lease)
    _generation = property(lambda self: self.servers.generation)

    def _count(self, event: str, n: int = 1) -> None:
        with self._events_lock:
            self.events[event] += n

    def _read_model(self) -> None:
        config = self._client().get_model_config(self.model_name, as_json=True)["config"]
        outputs = {o["name"]: o for o in config.get("output", [])}
        set_outputs = [tn.set_output(name, i) for i in range(1, len(self.more) + 1) for name in tn.SET_OUTPUTS]
        self._embeddings = [b.spec.embedding is not None for b in (self.bundle, *self.more)]
        set_outputs += [tn.set_output(tn.OUTPUT_EMBEDDING, i) for i, has in enumerate(self._embeddings) if has]
        missing = [name for name in (*tn.REQUIRED_OUTPUTS, *set_outputs) if name not in outputs]
        missing += [name for name in tn.INPUTS if name not in {i["name"] for i in config.get("input", [])}]
        if missing:
            raise TritonError(f"model {self.model_name!r} at {self.url} lacks {', '.join(missing)} (answers "
                              "cannot be checked); serve a repository built by `bulk-classify repo build`"
                              + (f" for this set of {len(self.more) + 1} models" if self.more else "")
                              + (" with its embeddings" if any(self._embeddings) else ""))
        self.repository_k = int(outputs[tn.OUTPUT_SCORES]["dims"][0])
        # each model's k: the run's top_k, at most its own classes (a run caps top_k at a set's largest model's)
        self._top_ks = [min(self.top_k, b.num_classes) for b in (self.bundle, *self.more)]
        for i, (k, b) in enumerate(zip(self._top_ks, (self.bundle, *self.more))):
            served = int(outputs[tn.set_output(tn.OUTPUT_SCORES, i)]["dims"][0])
            if k > served:
                raise ConfigError(f"top_k={self.top_k} but the repository returns {served} classes per image"
                                  + (f" for model {b.name!r}" if self.more else "")
                                  + f"; lower top_k or rebuild the repository with top_k >= {k}")
        for i, b in enumerate((self.bundle, *self.more)):
            dims = outputs.get(tn.set_output(tn.OUTPUT_EMBEDDING, i), {}).get("dims", [])
            if b.spec.embedding is not None and [int(d) for d in dims] != [b.spec.embedding.dim]:
                raise TritonError(f"model {self.model_name!r} at {self.url} answers {b.name!r}'s embedding as {dims}, "
                                  f"not [{b.spec.embedding.dim}]; serve a repository built for this model")
        self.has_error_output = tn.OUTPUT_ERROR in outputs
        params = config.get("parameters", {})
        self.server_checks_caps = params.get(tn.PARAM_CHECKS_CAPS, {}).get("string_value", "") == "true"
        self._wanted = [*tn.REQUIRED_OUTPUTS, *set_outputs] + ([tn.OUTPUT_ERROR] if self.has_error_output else [])

    def _client(self):
        """One gRPC client per thread and per server generation (a restarted server has new ports)."""
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        if getattr(self._local, "generation", None) != self._generation or getattr(self._local, "url", None) != self.url:
            self._local.client = grpcclient.InferenceServerClient(self.url)
            self._local.generation = self._generation
            self._local.url = self.url
        return self._local.client

    # ---- classify ------------------------------------------------------------------------------------------

    def answers(self, images: Sequence[bytes]) -> list[Answer]:
        """One Answer per input, in order; a bad input's is its error."""
        self.servers.health_check()
        results: list[Answer | None] = [None] * len(images)
        to_send: list[int] = []
        for i, data in enumerate(images):
            try:
                check_caps(data, self.limits, pixels=not self.server_checks_caps)
                to_send.append(i)
            except ImageError as err:
                results[i] = Answer(error=str(err))
        groups = plan_requests([len(images[i]) for i in to_send], self.request_batch)
        futures = [self._pool.submit(self._isolating, [to_send[j] for j in group], images) for group in groups]
        for future in futures:
            for index, result in future.result():
                results[index] = result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _isolating(self, indices: list[int], images: Sequence[bytes]) -> list[tuple[int, Answer]]:
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        try:
            return list(zip(indices, self._infer([images[i] for i in indices])))
        except InferenceServerException as err:
            reason = (err.message() or str(err)).strip()
            if len(indices) == 1:
                return [(indices[0], Answer(error=error_text(reason)))]
            LOG.info("request of %d images failed (%s); splitting it to isolate the input", len(indices), reason[:200])
        except _NoAnswer as err:
            return [(i, Answer(error=str(ImageError("engine_error", str(err))))) for i in indices]
        except _ServerDown as err:
            if self._in_quarantine() and len(indices) == 1:
                return [(indices[0], Answer(error=str(ImageError("engine_error", str(err)))))]
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
        (``wire.encode_request``: the files copied once) or protobuf messages."""
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

    def _infer(self, blobs: list[bytes]) -> list[Answer]:
        """One request, its answer checked; restarts a dead server and retries, sends a timed-out or mismatched
        request again. Raises InferenceServerException for a bad request, _NoAnswer when retries ran out."""
        import grpc  # noqa: PLC0415
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        retries = list(EXTERNAL_RETRY_S)
        restarts = failovers = mismatches = timeouts = 0
        while True:
            with self._quarantine:  # wait while another thread isolates a crashing input
                generation, url = self.servers.generation, self.url
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
                if (self.servers.generation, self.url) != (generation, url):
                    continue  # the server was restarted on new ports while this request was out: send it there
                stub_dead = STUB_DEAD_MARKER in (err.message() or str(err))
                if not (stub_dead or self._server_down(err)):
                    raise
                if self.server is None:
                    if stub_dead and self._lease is None:
                        raise  # not ours to restart: each input of the request becomes an error row
                    if not retries and self._lease is not None and failovers < MAX_RESTARTS_PER_REQUEST + 1:
                        self.servers.take_lease_again(url)
                        retries, failovers = list(EXTERNAL_RETRY_S), failovers + 1
                        continue
                    if not retries and self._lease is not None:
                        raise _NoAnswer(f"the shared tritonserver at {self.url} stopped answering ({err})") from None
                    if not retries:
                        raise EngineError(f"tritonserver at {self.url} stopped answering ({err}); check that it "
                                          "is running, or let the engine start its own (no url)") from None
                    time.sleep(retries.pop(0))
                    continue
                moved = self.servers.restart(generation, stub_dead)  # restarted, here or by another request
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

    def _checked(self, response, tags) -> list[Answer]:
        """The request's answers, once every row's ECHO is its own image's TAG; else AnswerMismatch."""
        check_answer(response, tags)
        results = self._answers(response, len(tags))
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

    def _answers(self, response, n: int) -> list[Answer]:
        tops, widths, heights, texts = parse_response(response, n, self.has_error_output, self._embeddings)

        def row(top, i: int, k: int):  # one model's (class ids, scores, embedding or None) of image i
            ids, scores, vectors = top
            return ids[i, :k], scores[i, :k], None if vectors is None else vectors[i]

        answers = []
        for i in range(n):
            ids, scores, vector = row(tops[0], i, self._top_ks[0])
            more = () if texts[i] else [row(top, i, k) for top, k in zip(tops[1:], self._top_ks[1:])]
            answers.append(Answer(ids, scores, int(widths[i]) or None, int(heights[i]) or None, texts[i], more,
                                  None if texts[i] else vector))
        return answers

    # ---- close ---------------------------------------------------------------------------------------------

    def close(self, *, graceful: bool = True, linger_s: float | None = None) -> None:
        """Lets the requests in flight finish, then stops the server this engine started (``ServerSupervisor.close``:
        a shared one once its other users have left, up to ``linger_s``; ``graceful=False`` kills it)."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        servers = getattr(self, "servers", None)
        if servers is not None:
            servers.close(graceful=graceful, linger_s=linger_s)

    def __enter__(self) -> "TritonClient":
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
                 gpus: Sequence[str | None], more: Sequence[Any] = ()):
        self.engines: list[TritonClient] = []  # every one started (their events stay readable after close)
        self._lock = threading.Lock()
        self._stopper: threading.Thread | None = None
        self._threads = [threading.Thread(target=self._start, args=(bundle, top_k, limits, options, gpu, more),
                                          name=f"tritonserver-start-{gpu or 'node'}", daemon=True) for gpu in gpus]
        for thread in self._threads:
            thread.start()

    def _start(self, bundle, top_k, limits, options, gpu: str | None, more: Sequence[Any]) -> None:
        try:
            engine = TritonClient(bundle, top_k=top_k, limits=limits, gpus=gpu, more=more, **options)
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


def start_node_servers(bundle, *, top_k: int, limits: DecodeLimits, options: Mapping[str, Any],
                       more: Sequence[Any] = ()) -> NodeServers | None:
    """The triton engine's ``EngineSpec.node_start``: in the driver of a local Ray, the shared server of each GPU
    (of the node, without GPUs), started in the background, for ``bundle`` and a model set's other models ``more``
    (the actors share it only where theirs is the same repository); None where the actors would not share one
    (``url``, ``share_server=false``)."""
    serving = choose_profile(options.get("profile", AUTO))
    if options.get("url") or not options.get("share_server", serving.share_server):
        return None
    # Actors without a GPU inherit the driver's CUDA_VISIBLE_DEVICES (Ray sets it only for GPU actors): their key
    # is the driver's own, None.
    return NodeServers(bundle, top_k=top_k, limits=limits, options=options, gpus=visible_gpus() or [None], more=more)
