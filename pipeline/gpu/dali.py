"""The gpu engine's preprocessing on DALI: the production ensemble's DALI graph, fed in process, torch-free.

``DaliPrep`` runs ``pipeline.gpu.dali_graph.preprocess_graph`` (the same definition the production profile's
DALI model uses) over one batch of unpadded encoded files, and the reference (``pipeline.model.imaging``, Pillow) over what
DALI does not take:

1. the caller's CPU triage (``pipeline.gpu.classifier.triage``) marks the JPEGs DALI decodes; anything else
   (PNG, CMYK, 12-bit, truncated, ...) goes to the reference;
2. DALI, "mixed" decoder with ``hw_decoder_load`` (the hardware JPEG engines take that share, CUDA
   nvJPEG the rest), resize + crop + normalize per the model's ``PreprocessSpec``, FP16 or FP32, NHWC on the GPU;
   its output goes to the caller's ``consume`` while it is valid (``GpuClassifier`` copies it into the network's
   input without leaving the GPU).

A file DALI refuses fails DALI's whole batch: that batch is then decoded by the reference, so a bad file is that
file's error row (the reference's status and kind, as the onnx engine gives) and its neighbours are classified.
With ``depth`` > 1 callers share one DALI pipeline kept that many batches ahead (``pipeline.gpu.dali_runner``);
with 1, each takes one of as many built pipelines, run one batch at a time. CI runs it with DALI's CPU backend
(tests/integration/test_engine_dali.py).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from pipeline.errors import EngineError, ImageError
from pipeline.model.imaging import DecodeLimits, PreprocessSpec, load_and_preprocess_each
from pipeline.gpu.dali_graph import ENCODED, branch_plan, first_line, preprocess_graphs
from pipeline.gpu.dali_runner import DALI_ERRORS, DaliRefused, Runner, consumed
from pipeline.gpu.defaults import DALI_THREADS, GPU_DEFAULT_BATCH_SIZE

LOG = logging.getLogger(__name__)

# Share of each batch given to the hardware JPEG engines (the rest: CUDA nvJPEG on the SMs): all of it leaves the SMs
# to the network.
DEFAULT_HW_DECODER_LOAD = 1.0
# Batches scheduled at once on the classifier's one DALI pipeline (1: one pipeline per preparing thread, each run
# alone); a deeper pipeline keeps the hardware decoders busy while the network runs.
DEFAULT_DALI_DEPTH = 3
# What to install where DALI is missing (pyproject's ``dali`` and ``gpu`` extras), and the one line a gpu classifier
# fails with then; the gpu engine's preflight says the same before a run.
DALI_INSTALL = "decodes and resizes with DALI, which is not installed here: pip install 'bulk-classify[dali]'"
DALI_MISSING = f"the gpu engine {DALI_INSTALL} (nvidia-dali-cuda130; the gpu extra includes it)"


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401,PLC0415 - optional
    except ImportError:
        return False
    return True


@dataclass
class Prepared:
    """One batch's preprocessing outcome, by position in the batch."""

    dali: list[int] = field(default_factory=list)  # positions whose rows DALI produced, in that order
    reference: dict[int, tuple[np.ndarray, int, int]] = field(default_factory=dict)  # pos -> (array, w, h)
    # pos -> the other branches' arrays, in branch order (a model set whose specs differ; empty otherwise)
    reference_more: dict[int, list[np.ndarray]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # pos -> "kind: detail"
    refused: str = ""  # DALI's reason when it refused the batch (its files went to the reference)


class DaliPrep:
    """Built DALI pipelines over unpadded encoded files, and the reference for what DALI does not take.

    Args:
        spec: the model's preprocessing.
        device: "mixed" (GPU decode; needs ``device_id``) or "cpu" (tests).
        batch_size: the largest batch; smaller ones are fed as they are.
        num_threads: DALI's CPU threads per pipeline.
        hw_decoder_load: share of each batch for the hardware JPEG engines (mixed only).
        half: FP16 output (else FP32).
        layout: "HWC" (the network's channels-last input) or "CHW".
        pipelines: how many pipelines (one per preparing thread; depth 1).
        depth: batches scheduled at once on one pipeline (> 1: ``Runner``; ``pipelines`` is then ignored).
        fancy_upsampling: the reference's chroma upsampling (False only to measure its cost: parity needs it).
        more: a model set's other models' specs: each image is decoded once, and each distinct spec
            (``pipeline.gpu.dali_graph.branch_plan``) is a branch of the one pipeline; ``consume`` then receives a
            tuple of outputs, one per branch (``branches``), and the reference gives every branch too.
    """

    def __init__(self, spec: PreprocessSpec, *, device: str = "mixed", device_id: int | None = None,
                 batch_size: int = GPU_DEFAULT_BATCH_SIZE, num_threads: int = DALI_THREADS,
                 hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD, half: bool = False, layout: str = "HWC",
                 pipelines: int = 1, depth: int = 1, fancy_upsampling: bool = True,
                 more: Sequence[PreprocessSpec] = ()):
        if not dali_available():
            raise EngineError(DALI_MISSING)
        if device not in ("mixed", "cpu"):
            raise EngineError(f"DALI device must be 'mixed' or 'cpu', got {device!r}")
        if not 0.0 <= hw_decoder_load <= 1.0:
            raise EngineError(f"hw_decoder_load must be within 0..1, got {hw_decoder_load}")
        self.spec = spec
        self.branches, self.branch_of = branch_plan((spec, *more))
        self._args = dict(device=device, device_id=(device_id or 0) if device == "mixed" else None,
                          batch_size=batch_size, num_threads=num_threads, hw_decoder_load=hw_decoder_load,
                          half=half, layout=layout, fancy_upsampling=fancy_upsampling)
        if depth < 1:
            raise EngineError(f"the DALI queue depth must be at least 1, got {depth}")
        self.batch_size = batch_size
        self.depth = depth
        self._pool: queue.Queue = queue.Queue()
        self._runner: Runner | None = None
        if depth > 1:
            self._runner = Runner(self._build, depth)
        else:
            for _ in range(max(1, pipelines)):
                self._pool.put(self._build())

    def _build(self):
        import nvidia.dali.fn as fn  # noqa: PLC0415 - optional, heavy
        import nvidia.dali.types as types  # noqa: PLC0415
        from nvidia.dali import pipeline_def  # noqa: PLC0415

        a = self._args

        # Depth 1: fed and run one batch at a time, overlap from several pipelines in several threads. Depth > 1:
        # one pipeline with that many batches scheduled at once (``Runner``), so DALI overlaps the CPU, decoder
        # and GPU stages of consecutive batches. The graph's sizes go from GPU to CPU, which DALI allows only with
        # the async pipelined executor.
        @pipeline_def(batch_size=a["batch_size"], num_threads=a["num_threads"], device_id=a["device_id"],
                      prefetch_queue_depth=self.depth, exec_async=True, exec_pipelined=True)
        def graph():
            encoded = fn.external_source(name=ENCODED, dtype=types.UINT8, ndim=1, device="cpu")
            outs, _, _ = preprocess_graphs(encoded, self.branches, device=a["device"], half=a["half"],
                                           hw_decoder_load=a["hw_decoder_load"] if a["device"] == "mixed" else None,
                                           layout=a["layout"], fancy_upsampling=a["fancy_upsampling"])
            return tuple(outs)

        pipe = graph()
        pipe.build()
        return pipe

    @contextlib.contextmanager
    def batch(self, blobs: Sequence[bytes]):
        """Runs one batch (at most ``batch_size`` files); yields DALI's output TensorList (a tuple of them, one per
        branch, with several branches), valid inside the block.

        Raises:
            DaliRefused: DALI failed the batch (the pipeline is rebuilt; nothing of the batch is usable).
        """
        if not 0 < len(blobs) <= self.batch_size:
            raise ValueError(f"a DALI batch holds 1..{self.batch_size} files, got {len(blobs)}")
        if self._runner is not None:
            raise RuntimeError("a DaliPrep of depth > 1 runs batches through prepare() (or run()), not batch()")
        pipe = self._pool.get()
        try:
            try:
                pipe.feed_input(ENCODED, [np.frombuffer(b, dtype=np.uint8) for b in blobs])
                outs = pipe.run()
            except DALI_ERRORS as err:
                pipe = self._build()  # a failed run leaves the pipeline unusable
                raise DaliRefused(first_line(err)) from None
            yield consumed(outs)
        finally:
            self._pool.put(pipe)

    def run(self, blobs: Sequence[bytes], consume: Callable[[Any], None]) -> None:
        """Runs one batch and gives its output to ``consume`` while it is valid (with depth > 1 from the runner's
        thread, while other batches are in flight).

        Raises:
            DaliRefused: DALI failed the batch.
        """
        if self._runner is None:
            with self.batch(blobs) as out:
                consume(out)
            return
        if not 0 < len(blobs) <= self.batch_size:
            raise ValueError(f"a DALI batch holds 1..{self.batch_size} files, got {len(blobs)}")
        self._runner.submit(blobs, consume).result()

    def prepare(self, datas: Sequence[bytes], to_dali: Sequence[bool], limits: DecodeLimits,
                consume: Callable[[Any], None], cpu_pool: Executor | None = None) -> Prepared:
        """Preprocesses one batch: files marked ``to_dali`` through DALI (``consume`` receives its output while it is
        valid), the others, and all of a refused DALI batch, through the reference; a bad file is its own error."""
        res = Prepared()
        dali_pos = [i for i, flag in enumerate(to_dali) if flag]
        ref_pos = [i for i, flag in enumerate(to_dali) if not flag]
        if dali_pos:
            try:
                self.run([datas[i] for i in dali_pos], consume)
                res.dali = dali_pos
            except DaliRefused as err:
                LOG.info("DALI refused a batch of %d (%s); the reference decodes it", len(dali_pos), err)
                res.refused = str(err)
                ref_pos = sorted(ref_pos + dali_pos)

        def one(i: int):
            try:
                return load_and_preprocess_each(datas[i], self.branches, limits)
            except ImageError as e:
                return str(e)

        outcomes = cpu_pool.map(one, ref_pos) if cpu_pool is not None and len(ref_pos) > 1 else map(one, ref_pos)
        for i, out in zip(ref_pos, outcomes):
            if isinstance(out, str):
                res.errors[i] = out
            else:
                arrs, w, h = out
                arrs = [np.ascontiguousarray(self._host_layout(arr, spec)) for arr, spec in zip(arrs, self.branches)]
                res.reference[i] = (arrs[0], w, h)
                if len(arrs) > 1:
                    res.reference_more[i] = arrs[1:]
        return res

    def _host_layout(self, arr: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
        return arr.transpose(1, 2, 0) if self._args["layout"] == "HWC" and spec.layout == "NCHW" else arr

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
        while not self._pool.empty():
            self._pool.get_nowait()


def host_array(out) -> np.ndarray:
    """A DALI output TensorList (CPU or GPU) as one host array [n, ...] (tests and the CPU path)."""
    if hasattr(out, "as_cpu"):
        out = out.as_cpu()
    return np.array(out.as_tensor())
