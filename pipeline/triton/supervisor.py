"""The Triton client's server supervision: the tritonserver it talks to, whether its own (started under a private MPS
daemon, restarted when it dies, watched while shared), one shared with the other actors of its GPU (the lease, and
the failover when its owner's server stops answering), or an external one at a given url."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from typing import Any, Callable, Sequence

from pipeline.errors import TritonError
from pipeline.schema import DEFAULT_TOP_K
from pipeline.triton.profiles import ServingProfile
from pipeline.triton.server import HEALTH_TIMEOUT_S
from pipeline.triton.workdirs import REPOSITORY_PREFIX, sweep_dead_owner_folders

LOG = logging.getLogger(__name__)

# The owner of a shared server checks its process this often, between its own requests too: the server's other
# users wait for the owner to restart it, and an owner with no batch in flight would leave them waiting.
WATCH_S = 1.0
# The supervision's counters, part of the engine's (``pipeline.triton.client.EVENTS``).
EVENT_STARTS = "server_starts"  # tritonservers this engine started (a shared one counts for its owner only)
EVENT_RESTARTS = "server_restarts"  # restarts of a server this engine owns
EVENT_FAILOVERS = "server_failovers"  # moves of a shared-server user to another server (restarted, or its own)


class ServerSupervisor:
    """The server one engine sends its requests to, and what keeps it answering.

    Args:
        profile: the serving profile whose repository the server serves (its GPU needs and MPS default).
        model_name: the model the engine calls (readiness is that model's).
        startup_timeout_s: how long to wait for a server to be ready, own or shared.
        use_mps: start a private CUDA MPS daemon for a server of our own on a GPU.
        share: share one local server between the engines of this node that would start the same one.
        gpus: the GPU(s) of a server this supervisor starts, as CUDA_VISIBLE_DEVICES names them.
        count: the engine's event counter, called with an ``EVENT_*`` name.

    ``url`` and ``generation`` change together when the server moves (a restart on new ports, a failover): the
    engine's clients are per generation. ``restart_lock`` serializes restarts and failovers.
    """

    def __init__(self, *, profile: ServingProfile, model_name: str, startup_timeout_s: float, use_mps: bool,
                 share: bool, gpus: str | None, count: Callable[..., None]):
        self.profile = profile
        self.model_name = model_name
        self.startup_timeout_s = startup_timeout_s
        self.use_mps = use_mps
        self.share = share
        self.gpus = gpus
        self._count = count
        self.url: str | None = None
        self.server = None  # pipeline.triton.server.TritonServer, when this engine owns the server
        self.lease = None  # pipeline.triton.sharing.ServerLease when the server is shared
        self.generation = 0
        self.restart_lock = threading.Lock()
        self._start: Callable[[], Any] | None = None
        self._mps = None  # pipeline.triton.mps.MpsDaemon of the server this engine owns
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None

    # ---- start -------------------------------------------------------------------------------------------------

    def start_own(self, bundle, repository: str | None, instances: int | None, top_k: int,
                  server_args: Sequence[str], more: Sequence = (), half: bool | None = None) -> None:
        """Start (or, shared, join) a server of ``repository``, default the profile's built for ``bundle`` (and a
        model set's other models, ``more``; ``half``: its networks' precision, None the gate's)."""
        from pipeline.triton.checks import preflight  # noqa: PLC0415
        from pipeline.triton.repository_cache import cached_repository  # noqa: PLC0415
        from pipeline.triton.server import TritonServer  # noqa: PLC0415

        if repository is None:
            sweep_dead_owner_folders(REPOSITORY_PREFIX)
            # one repository serves every top-k up to the default, but never more classes than the model (a set's
            # largest) has
            served_k = min(max(top_k, DEFAULT_TOP_K), max(b.num_classes for b in (bundle, *more)))
            repository = str(cached_repository(self.profile, bundle, top_k=served_k, instances=instances, more=more,
                                               half=half))
        preflight(repository)

        def start():
            env = self._start_mps()
            if self.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = self.gpus
            try:
                server = TritonServer(repository, startup_timeout_s=self.startup_timeout_s,
                                      extra_args=server_args, env=env).start()
            except BaseException:
                self._stop_mps()
                raise
            return server

        if not self.share:
            self.server = start()
            self.url = self.server.grpc_url
            self._count(EVENT_STARTS)
            return
        from pipeline.triton.sharing import ServerLease, lease_key  # noqa: PLC0415

        self.lease = ServerLease(lease_key(repository, server_args, self.model_name, self.gpus))
        self._start = start
        self.url, self.server = self.lease.acquire(start)
        self.lease.join()
        if self.server is None:
            self.wait_external(self.startup_timeout_s)
        else:
            self._count(EVENT_STARTS)
            self._watch()

    def wait_external(self, timeout_s: float, url: str | None = None) -> None:
        """Wait until the model is ready at ``url`` (then ours), a server this engine does not own."""
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        if url is not None:
            self.url = url
        client = grpcclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                if client.is_model_ready(self.model_name, client_timeout=HEALTH_TIMEOUT_S):
                    return
            except Exception as err:  # noqa: BLE001 - keep polling until the deadline
                last = err
            time.sleep(0.5)
        raise TritonError(f"model {self.model_name!r} at {self.url} not ready after {timeout_s:.0f} s ({last}); "
                          "start the server first or drop --engine-option url=... to let each actor start its own")

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

    # ---- keep it answering -------------------------------------------------------------------------------------

    def health_check(self) -> None:
        """Between batches: restart our server if it died or stopped answering."""
        if self.server is not None:
            with self.restart_lock:
                if self.server.ensure_running():
                    self._after_restart()

    def restart(self, generation: int, stub_dead: bool) -> bool:
        """Our server failed a request sent at ``generation``: restart it if it is dead (or its python-backend stub
        is), unless another request's thread did already. Whether the server moved since ``generation``."""
        with self.restart_lock:
            if self.generation == generation:
                if stub_dead:
                    self.server.restart()
                    self._after_restart()
                elif self.server.ensure_running():
                    self._after_restart()
            return self.generation != generation

    def take_lease_again(self, failed: str) -> None:
        """Our shared server (at ``failed``) stopped answering: find its restarted successor, or start one and
        own it (``ServerLease.acquire``: never while its process lives). Nothing to do when another thread
        already moved on from ``failed``."""
        with self.restart_lock:
            if self.url != failed:
                return
            url, server = self.lease.acquire(self._start, exclude_url=failed, wait_s=self.startup_timeout_s)
            if url == failed:
                LOG.info("shared tritonserver %s is slow to answer but alive; still sharing it", failed)
                return
            self.url, self.server = url, server
            self.generation += 1
            self._count(EVENT_FAILOVERS)
            if self.server is None:
                self.wait_external(self.startup_timeout_s)
            else:
                self._count(EVENT_STARTS)
                self._watch()
            LOG.warning("shared tritonserver %s stopped answering; now %s (%s)", failed, self.url,
                        "ours" if self.server is not None else "shared")

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
                with self.restart_lock:
                    if self.server is server and not self._closing.is_set() and server.ensure_running():
                        self._after_restart()
            except Exception as err:  # noqa: BLE001 - the next request's own restart path reports it
                LOG.warning("tritonserver watchdog: restarting the shared server failed (%s)", err)

    def _after_restart(self) -> None:
        self.url = self.server.grpc_url
        if self.lease is not None:
            self.lease.publish(self.server)
        self.generation += 1
        self._count(EVENT_RESTARTS)
        LOG.warning("tritonserver restarted (restart #%d); now at %s", self.server.restarts, self.url)

    # ---- stop --------------------------------------------------------------------------------------------------

    def close(self, *, graceful: bool = True, linger_s: float | None = None) -> None:
        """Stops the server this engine started (a shared one once its other users have left, up to ``linger_s``,
        default sharing.LINGER_S) and its MPS daemon; ``graceful=False`` kills it instead of letting its
        instances unload (seconds each), for a server whose work is done."""
        self._closing.set()
        if self._watchdog is not None:
            self._watchdog.join(self.startup_timeout_s)
        if self.server is not None:
            if self.lease is not None:
                self.lease.release(self.server, **({} if linger_s is None else {"linger_s": linger_s}))
            self.server.stop(graceful=graceful)
            self.server = None
        elif self.lease is not None:
            self.lease.leave()
        self._stop_mps()
