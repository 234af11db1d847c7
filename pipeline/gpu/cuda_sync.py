"""How a process's threads wait for its GPU: the scheduling flag of the device's primary CUDA context.

CUDA's default ("auto") makes a thread that waits for the GPU (an event's or a stream's synchronize, a blocking
copy) spin on its core whenever the process has fewer contexts than the machine has cores, i.e. always here. The gpu
profile's model has several such waiters per process (the network's results, DALI's output copies) and several
processes per GPU (one per model instance, and the actors), so on a shared node spinning takes cores that triage,
DALI's CPU stage and the Triton hop need. "block" makes them sleep until the GPU is done.

The flag belongs to the primary context, which torch, DALI and the python backend share: it is set through the
driver API (libcuda) by ``set_cuda_sync``, before the context is active where possible and on the active context
otherwise.
"""

from __future__ import annotations

import ctypes
import logging

from pipeline.errors import EngineError
from pipeline.gpu.defaults import CUDA_SYNC_MODES

LOG = logging.getLogger(__name__)

SYNC_FLAGS = dict(zip(CUDA_SYNC_MODES, (0, 1, 2, 4)))  # CU_CTX_SCHED_* of each mode
_SCHED_MASK = 7


def check_cuda_sync(mode: str) -> str:
    if mode not in SYNC_FLAGS:
        raise EngineError(f"cuda_sync must be one of {', '.join(SYNC_FLAGS)}, got {mode!r}")
    return mode


def set_cuda_sync(index: int, mode: str) -> str:
    """Sets how threads wait for device ``index`` ("auto", "spin", "yield", "block"); returns the mode in force
    afterwards on the current context, or "unknown" where the driver cannot be asked (no libcuda: a CPU run).

    Call it on the thread that uses the device, after the device was made current (``torch.cuda.set_device``)."""
    flag = SYNC_FLAGS[check_cuda_sync(mode)]
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "unknown"
    dev = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), int(index)) != 0:
        return "unknown"
    primary = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    primary(dev, flag)  # takes effect when the context is created; may be refused while it is active
    current = ctypes.c_uint()
    if cuda.cuCtxGetFlags(ctypes.byref(current)) != 0:  # no current context on this thread yet
        return mode
    if current.value & _SCHED_MASK != flag and hasattr(cuda, "cuCtxSetFlags"):  # CUDA 12.1+: the active context
        rc = cuda.cuCtxSetFlags(ctypes.c_uint((current.value & ~_SCHED_MASK) | flag))
        if rc != 0:
            LOG.warning("could not set the CUDA context's scheduling flag to %s (CUresult %d)", mode, rc)
        cuda.cuCtxGetFlags(ctypes.byref(current))
    now = current.value & _SCHED_MASK
    return next((name for name, value in SYNC_FLAGS.items() if value == now), "unknown")


def use_cuda_device(torch, device, mode: str, autotune: bool = True) -> str:
    """Makes ``device`` (a ``torch.device``) this thread's, with cudnn's autotuner on (``autotune``) and ``mode``'s
    way of waiting; returns the mode in force ("none" on the CPU). ``torch`` is passed in: this module stays
    torch-free."""
    if device.type != "cuda":
        return "none"
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = autotune
    return set_cuda_sync(device.index, mode)
