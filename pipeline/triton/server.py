"""The one class that owns a local tritonserver process: find, start on loopback, wait ready, watch, restart, stop."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

from pipeline.errors import TritonError
from pipeline.node import LOOPBACK, pid_alive
from pipeline.triton import contract as tn
from pipeline.triton.workdirs import WORKDIR_PREFIX, owned_temp_folder, sweep_dead_owner_folders

LOG = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 40
STOPPED_LOG_LINES = 200  # kept in TritonServer.stopped_log once a server has stopped
PORT_RETRIES = 3
SHM_DIR = Path("/dev/shm")
# Where NVIDIA's Triton container keeps its backends, relative to the binary (bin/tritonserver).
CONTAINER_BACKENDS = Path("..") / "backends"
# Set this to a tritonserver binary to override discovery (e.g. a build outside PATH).
BINARY_ENV = "BULK_CLASSIFY_TRITONSERVER"
PR_SET_PDEATHSIG = 1
# The folder holding the `pipeline` package (a checkout or site-packages): the python backend stub imports from it.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
# The python backend stub ignores PYTHONPATH; our python models prepend this variable's folders to sys.path.
STUB_PATH_ENV = "BULK_CLASSIFY_PYTHONPATH"


class _Launcher:
    """Forks every server from one daemon thread.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. Engines restart servers
    from short-lived request threads (and Ray may run actor methods in pool threads), so every server is forked from
    this one thread. It is a daemon thread, not an executor's: interpreter shutdown joins executor threads before
    the atexit handlers run, which killed a server before its engine's close() could keep it for its other users.
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn, *args, **kwargs) -> Future:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tritonserver-launcher", daemon=True)
                self._thread.start()
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)


_LAUNCHER = _Launcher()


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGKILL to the server when the thread that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


SHM_PREFIX = "bulkcls_"
# How long one health check waits for an answer (a loaded host can keep a healthy server from answering in seconds).
HEALTH_TIMEOUT_S = 15.0
STARTUP_TIMEOUT_S = 120.0  # how long start() waits for the server to be ready, by default
# How long a live server may go without answering its health checks before it counts as hung and is restarted
# (ensure_running): minutes, so a slow server is waited for, never replaced.
HUNG_AFTER_S = 300.0
SHM_WATCH_S = 1  # how often the detached watcher of a server's shared memory looks whether the server is gone


def sweep_stale_shared_memory() -> list[str]:
    """Removes /dev/shm files of our servers whose process is gone (a SIGKILLed actor cleans nothing).

    Names are ``bulkcls_<pid>_…``: the python backend's regions of the server that process started.
    """
    removed = []
    for path in SHM_DIR.glob(SHM_PREFIX + "*"):
        pid_text = path.name[len(SHM_PREFIX):].split("_")[0]
        if not pid_text.isdigit() or pid_alive(int(pid_text)):
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    if removed:
        LOG.info("removed %d shared-memory file(s) of dead processes: %s", len(removed), ", ".join(removed[:5]))
    return removed


def _remove_shared_memory_when_gone(pid: int, prefix: str) -> None:
    """Starts a detached shell that removes the server's /dev/shm files once the server process is gone, however it
    ends: Ray may SIGKILL an actor in the middle of its exit, before its own cleanup runs, and kills only a worker's
    children, not this shell (reparented to init)."""
    pattern = f"{shlex.quote(str(SHM_DIR))}/{prefix}*"
    # Gone or a zombie (its state, the third field of /proc/PID/stat, is Z): a zombie's parent may never reap it.
    stat = f"/proc/{pid}/stat"
    script = (f'while read -r _ _ state _ < {stat} && [ "$state" != Z ]; do sleep {SHM_WATCH_S}; done 2>/dev/null; '
              f"rm -f {pattern}")
    subprocess.Popen(  # noqa: S603 - our own command line; the outer shell exits at once
        ["sh", "-c", f"({script}) </dev/null >/dev/null 2>&1 &"], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True).wait()


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports: all held at once while picked, since a port closed and picked again
    can come back twice (tritonserver refuses to serve HTTP and metrics on one port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for sock in socks:
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in socks]


def _pytriton_dist() -> Path | None:
    try:
        import pytriton  # noqa: PLC0415 - optional: only needed when no tritonserver is on PATH
    except ImportError:
        return None
    root = Path(pytriton.__file__).resolve().parent
    return root if (root / "tritonserver" / "bin" / "tritonserver").exists() else None


class TritonServer:
    """A tritonserver child process bound to 127.0.0.1 on free ports, with its own shared-memory prefix.

    The server class knows nothing of the profile: give it a repository folder and extra arguments.
    Use as a context manager, or call ``start()`` / ``stop()``::

        with TritonServer("model_repository/portable") as server:
            client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

    Args:
        repository: the model repository folder (``--model-repository``).
        extra_args: more tritonserver arguments (e.g. ``["--log-verbose=1"]``).
        startup_timeout_s: how long ``start()`` waits for readiness before failing with the log tail.
        binary: a tritonserver binary; default: ``$BULK_CLASSIFY_TRITONSERVER``, then ``tritonserver`` on
            PATH (NVIDIA's container), then the one in the ``nvidia-pytriton`` wheel.
        env: extra environment variables for the server (and its python backend stubs).
    """

    def __init__(
        self,
        repository: str | os.PathLike,
        *,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        binary: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
    ):
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise TritonError(
                f"model repository {self.repository} is not a folder; build one with "
                "`bulk-classify repo build --profile portable --output DIR`"
            )
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.extra_env = dict(env or {})
        self._binary, self._backend_dir, self._libs_dir = self._locate(binary)
        self._workdir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._lock = threading.RLock()
        self.shm_prefix = ""
        self.http_port = self.grpc_port = self.metrics_port = 0
        self.restarts = 0
        self.stopped_log = ""  # the end of the log of the last server that stopped (models' finalize lines included)

    # ---- discovery -------------------------------------------------------------------------------

    @staticmethod
    def _locate(binary: str | os.PathLike | None) -> tuple[Path, Path | None, Path | None]:
        """Return (binary, backend directory or None for the binary's default, extra library folder)."""
        explicit = binary or os.environ.get(BINARY_ENV)
        if explicit:
            path = Path(explicit)
            if not path.is_file():
                raise TritonError(f"tritonserver binary {path} does not exist; fix {BINARY_ENV} or the path given")
            return path, _container_backends(path), None
        on_path = shutil.which("tritonserver")
        if on_path:
            return Path(on_path), _container_backends(Path(on_path)), None
        dist = _pytriton_dist()
        if dist is None:
            raise TritonError(
                "no tritonserver found on PATH or in the nvidia-pytriton wheel; run inside NVIDIA's Triton "
                f"container, `pip install nvidia-pytriton==0.7.0`, or set {BINARY_ENV}"
            )
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = dist / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.exists():
            raise TritonError(f"nvidia-pytriton has no python backend stub for Python {version}; use Python 3.8-3.13")
        return dist / "tritonserver" / "bin" / "tritonserver", None, dist.parent / "nvidia_pytriton.libs"

    def _prepare_backends(self, workdir: Path) -> Path | None:
        """For the wheel's server, lay out backends/ with the stub of this Python (symlinks, no copies)."""
        if self._libs_dir is None:
            return self._backend_dir
        dist = self._binary.parent.parent
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        python_dir = workdir / "backends" / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        for item in (dist / "backends" / "python").iterdir():
            if item.is_file():
                (python_dir / item.name).symlink_to(item)
        (python_dir / "triton_python_backend_stub").symlink_to(
            dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        )
        return workdir / "backends"

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The python backend stub embeds this Python: it needs libpython, the venv's packages and this repo.
        lib_dirs = [str(self._libs_dir)] if self._libs_dir else []
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir:
            lib_dirs.append(libdir)
        if env.get("LD_LIBRARY_PATH"):
            lib_dirs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
        # This interpreter's package folders (venv, site- and dist-packages, PYTHONPATH), in its own order.
        package_dirs = [p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)]
        package_dirs += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        paths = [str(PACKAGE_PARENT)]
        for path in [*env.get("PYTHONPATH", "").split(os.pathsep), *package_dirs]:
            if path and path not in paths:
                paths.append(path)
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env[STUB_PATH_ENV] = env["PYTHONPATH"]
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.update(self.extra_env)
        return env

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{LOOPBACK}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _command(self, backend_dir: Path | None) -> list[str]:
        cmd = [
            str(self._binary),
            f"--model-repository={self.repository}",
            f"--http-address={LOOPBACK}",
            f"--http-port={self.http_port}",
            f"--grpc-address={LOOPBACK}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={LOOPBACK}",
            f"--metrics-port={self.metrics_port}",
            "--exit-on-error=true",
            "--strict-readiness=true",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        if self._libs_dir is not None:
            # The wheel's server has only the local response cache; point it there.
            cmd.append(f"--cache-directory={self._binary.parent.parent / 'caches'}")
        return cmd + self.extra_args

    def start(self) -> "TritonServer":
        """Start the server and wait until every model is ready; raises TritonError with the log tail."""
        with self._lock:
            if self.is_alive():
                return self
            last_error: TritonError | None = None
            for attempt in range(PORT_RETRIES):
                try:
                    self._spawn()
                    self._wait_ready()
                    return self
                except TritonError as err:
                    last_error = err
                    port_clash = "address already in use" in self.log_tail().lower()
                    self._terminate()
                    if not port_clash:
                        break
                    LOG.warning("tritonserver ports taken (attempt %d); retrying on new ports", attempt + 1)
            assert last_error is not None
            raise last_error

    def _spawn(self) -> None:
        sweep_stale_shared_memory()
        sweep_dead_owner_folders(WORKDIR_PREFIX)
        self._workdir = owned_temp_folder(WORKDIR_PREFIX)
        backend_dir = self._prepare_backends(self._workdir)
        self.http_port, self.grpc_port, self.metrics_port = _free_ports(3)
        # Unique per server, so two servers (two actors) never share python-backend shared memory.
        self.shm_prefix = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_"
        cmd = self._command(backend_dir)
        self._log_path = self._workdir / "tritonserver.log"
        self._log_file = open(self._log_path, "wb")  # noqa: SIM115 - closed in _terminate
        LOG.info("starting tritonserver on %s (grpc %d): %s", LOOPBACK, self.grpc_port, " ".join(cmd))
        self._proc = _LAUNCHER.submit(
            subprocess.Popen,  # noqa: S603 - our own command line
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            cwd=self._workdir,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - needed for PR_SET_PDEATHSIG
            start_new_session=True,  # its own process group, so stop() also reaps the backend stubs
        ).result()
        _remove_shared_memory_when_gone(self._proc.pid, self.shm_prefix)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise TritonError(
                    f"tritonserver exited with code {self._proc.returncode} while starting on repository "
                    f"{self.repository}; its log ends with:\n{self.log_tail()}"
                )
            if self.is_ready():
                LOG.info("tritonserver ready (pid %d, grpc %s)", self._proc.pid, self.grpc_url)
                for line in self._start_reports():
                    LOG.info("tritonserver %d: %s", self._proc.pid, line)
                return
            time.sleep(0.2)
        raise TritonError(
            f"tritonserver not ready after {self.startup_timeout_s:.0f} s (raise startup_timeout_s if the models "
            f"are slow to load); its log ends with:\n{self.log_tail()}"
        )

    def is_alive(self) -> bool:
        """True while the server process runs."""
        return self._proc is not None and self._proc.poll() is None

    def is_ready(self, timeout_s: float = 2.0) -> bool:
        """True when the server answers its readiness endpoint (all models loaded)."""
        if not self.is_alive():
            return False
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def ensure_running(self, hung_after_s: float = HUNG_AFTER_S) -> bool:
        """Health check between batches: restart a crashed or hung server. True if it was restarted.

        A live server is given ``hung_after_s`` to answer: on a saturated host a healthy server can take many seconds,
        and killing it would turn its requests into error rows and send the engines sharing it to servers of their own.
        """
        with self._lock:
            if self._answers_within(hung_after_s):
                return False
            LOG.warning(
                "tritonserver (pid %s) is %s; restarting it. Log tail:\n%s",
                self.pid,
                "not ready" if self.is_alive() else f"dead (exit code {self._proc.returncode if self._proc else None})",
                self.log_tail(),
            )
            self._terminate(graceful=False)
            self.restarts += 1
            self.start()
            return True

    def _answers_within(self, deadline_s: float) -> bool:
        """True when the server answers its readiness endpoint before ``deadline_s``; False once it is dead."""
        deadline, warned = time.monotonic() + deadline_s, False
        while self.is_alive():
            if self.is_ready(max(0.1, min(HEALTH_TIMEOUT_S, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                return False
            if not warned:
                LOG.warning("tritonserver (pid %s) is alive but not answering; waiting up to %.0f s before counting "
                            "it hung", self.pid, deadline_s)
            warned = True
            time.sleep(1.0)
        return False

    def restart(self) -> None:
        """Stop and start again (new ports, new shared memory): for a server that is up but cannot serve, e.g.
        one whose python backend stub crashed (Triton keeps answering "Stub process ... is not healthy")."""
        with self._lock:
            LOG.warning("restarting tritonserver (pid %s). Log tail:\n%s", self.pid, self.log_tail())
            self._terminate(graceful=False)  # it cannot serve: waiting for a clean unload only loses time
            self.restarts += 1
            self.start()

    def _start_reports(self) -> list[str]:
        """The served models' reports of what their start took (``contract.START_REPORT`` lines of the log)."""
        path = getattr(self, "_log_path", None)
        if path is None or not path.exists():
            return []
        text = path.read_bytes().decode("utf-8", errors="replace")
        return [line.split(tn.START_REPORT, 1)[1] for line in text.splitlines() if tn.START_REPORT in line]

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines the server wrote (stdout and stderr)."""
        path = getattr(self, "_log_path", None)
        if path is None or not path.exists():
            return "(no log)"
        text = path.read_bytes()[-256_000:].decode("utf-8", errors="replace")
        # Drop the option/model tables: they push the one error line that matters out of the tail.
        kept = [line for line in text.splitlines() if line.strip() and line[:1] not in "+|"]
        return "\n".join(kept[-lines:])

    def stop(self, graceful: bool = True) -> None:
        """Stop cleanly (SIGINT, wait, then SIGKILL), or at once with ``graceful=False``; remove its shared memory
        and work folder."""
        with self._lock:
            self._terminate(graceful)

    def _terminate(self, graceful: bool = True) -> None:
        proc = self._proc
        if proc is not None:
            if proc.poll() is None and not graceful:
                proc.kill()
                proc.wait()
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    LOG.warning("tritonserver (pid %d) ignored SIGINT for %.0f s; killing it", proc.pid, STOP_TIMEOUT_S)
                    proc.kill()
                    proc.wait()
            # Backend stubs share the server's process group; reap any that outlived it (e.g. after kill -9).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
            self.stopped_log = self.log_tail(STOPPED_LOG_LINES)
        if self.shm_prefix:
            for leftover in SHM_DIR.glob(f"{self.shm_prefix}*"):
                leftover.unlink(missing_ok=True)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # last resort; stop() is the contract
        try:
            if self._proc is not None and self._proc.poll() is None:
                self._terminate()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def find_tritonserver() -> Path:
    """The tritonserver binary a ``TritonServer`` would run here; TritonError says how to get one."""
    return TritonServer._locate(None)[0]


def _container_backends(binary: Path) -> Path | None:
    candidate = (binary.parent / CONTAINER_BACKENDS).resolve()
    return candidate if candidate.is_dir() else None
