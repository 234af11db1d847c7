"""TopKNetwork: a torch network on one device, FP16 or FP32, in a CUDA graph per batch size, with softmax + top-k
(a sigmoid per class for a multi-label model, top-k alone for a network whose output is probabilities already),
and the model's embedding where its spec declares one (the network then returns ``(logits, embedding)``).

The network half of the gpu engine: ``GpuClassifier`` runs it after DALI in one process (the benchmarks' ensemble
shape, ``tests/benchmarks/gpu_ensemble.py``, runs it alone in a ``network`` model).
"""

from __future__ import annotations

import copy
import logging
import time

from pipeline.errors import EngineError

LOG = logging.getLogger(__name__)

# The compiled network is kept where its logits on seeded random inputs are within this of the eager network's
# (||compiled - eager|| / ||eager||): fused kernels reorder sums, a wrong graph moves logits by far more.
COMPILE_REL_L2 = 1e-2
COMPILE_CHECK_SEED = 44


def split_outputs(out):
    """A network's output as (logits, embedding or None): a network of a model with an embedding returns the pair
    (a converted ``model.onnx`` returns its graph's outputs, class output first), any other its logits alone."""
    if isinstance(out, (tuple, list)):
        return out[0], (out[1] if len(out) > 1 else None)
    return out, None


def _each(out, fn):
    """``fn`` applied to a network's output: to the tensor, or to each tensor of a tuple of outputs."""
    return tuple(fn(o) for o in out) if isinstance(out, (tuple, list)) else fn(out)


class TopKNetwork:
    """A private, eval-mode copy of ``network`` on ``device`` (channels-last memory), returning top-k on the device.

    Args:
        network: a torch module mapping float [N, 3, H, W] to logits [N, classes].
        crop: the network's input (height, width).
        device: a ``torch.device``.
        half: FP16 weights and inputs (else FP32).
        batch_size: the CUDA graph's batch (smaller batches are padded into it).
        cuda_graph: capture the network per batch size (CUDA only).
        top_k: classes per image.
        probabilities: the network outputs probabilities (the spec's ``output``): no softmax after it.
        sigmoid: the network outputs a multi-label model's logits (the spec's ``output``): a sigmoid per class.
        fixed_batch: the network takes only batches of this size (its ONNX batch axis is a number): a batch runs in
            runs of exactly that many, the last one padded.
        compile: run the network through ``torch.compile`` (None: on CUDA, for a network that asks for it with a
            true ``compile_by_default`` attribute, as a converted ``model.onnx`` does). The compiled network's
            logits are checked against the eager network's at warmup; a failure or a difference beyond
            ``COMPILE_REL_L2`` keeps the eager network and says so once.
        embedding: the model's ``EmbeddingSpec`` (its spec's ``embedding``), or None: the network returns
            ``(logits, embedding)`` and ``answers`` returns the embedding too, float32, L2-normalised per the spec.
    """

    def __init__(self, network, *, crop: tuple[int, int], device, half: bool, batch_size: int, cuda_graph: bool,
                 top_k: int, probabilities: bool = False, fixed_batch: int | None = None,
                 compile: bool | None = None, sigmoid: bool = False, embedding=None):
        import torch  # noqa: PLC0415 - optional dependency, present on GPU machines

        self._torch = torch
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.crop = tuple(crop)
        self.half = half
        self.dtype = torch.float16 if half else torch.float32
        self.batch_size = fixed_batch or batch_size
        self.fixed_batch = fixed_batch
        self.use_graph = cuda_graph and self.is_cuda
        self.top_k = top_k
        self.probabilities = probabilities
        self.sigmoid = sigmoid
        self.embedding = embedding
        # A private copy: converting dtype/layout in place would change a module another classifier holds.
        net = copy.deepcopy(network).eval().to(device)
        net = net.to(memory_format=torch.channels_last)
        self.module = net.half() if half else net.float()
        self._graphs: dict[int, tuple] = {}
        if compile is None:
            compile = self.is_cuda and bool(getattr(network, "compile_by_default", False))
        self._eager = self.module if compile else None
        if compile:
            self.module = torch.compile(self.module, dynamic=False)
        self.compiled = bool(compile)  # until warmup's check says otherwise
        self.compile_problem = ""  # why the compiled network was not kept
        self.compile_seconds = 0.0  # compiling and checking it, at the first batch

    def warmup(self) -> None:
        """Builds the CUDA graph and cudnn plans for the full batch so the first real batch is not slow."""
        torch = self._torch
        x = torch.zeros(self.batch_size, 3, *self.crop, dtype=self.dtype, device=self.device)
        self.run(x.contiguous(memory_format=torch.channels_last))
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def _check_compiled(self) -> None:
        """Compiles (at the full batch) and compares the compiled network's logits with the eager network's on seeded
        inputs; keeps the eager network where compiling fails or the logits differ beyond ``COMPILE_REL_L2``."""
        torch = self._torch
        gen = torch.Generator(device="cpu").manual_seed(COMPILE_CHECK_SEED)
        x = torch.randn(self.batch_size, 3, *self.crop, generator=gen).to(self.device, self.dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        eager, self._eager = self._eager, None
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                want = _flat(eager(x))
                got = _flat(self.module(x))
            rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
            problem = "" if rel <= COMPILE_REL_L2 else f"its logits differ from the eager network's by {rel:.2e}"
        except Exception as err:  # noqa: BLE001 - any compiler failure: the eager network still runs
            problem = f"compiling failed ({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
        self.compile_seconds = time.perf_counter() - started
        if problem:
            LOG.warning("torch.compile of the network: %s; it runs uncompiled (slower)", problem)
            self.module, self.compiled, self.compile_problem = eager, False, problem
            return
        LOG.info("compiled the network with torch.compile in %.1f s (logits within %.1e of eager)",
                 time.perf_counter() - started, rel)

    def run(self, x):
        """Logits for a batch; a CUDA graph per padded batch size when enabled."""
        torch = self._torch
        if self._eager is not None:
            self._check_compiled()
        if self.fixed_batch and x.shape[0] != self.fixed_batch:
            parts = [self._run_padded(part) for part in x.split(self.fixed_batch)]
            return _each(tuple(zip(*parts)), torch.cat) if isinstance(parts[0], tuple) else torch.cat(parts)
        with torch.inference_mode():
            if not self.use_graph:
                return self.module(x)
            n = x.shape[0]
            size = self.batch_size if n <= self.batch_size else n
            graph = self._graphs.get(size)
            if graph is None:
                graph = self._capture(size, x)
            g, static_in, static_out = graph
            static_in[:n].copy_(x)
            g.replay()
            return _each(static_out, lambda o: o[:n])

    def _run_padded(self, part):
        """One run of exactly ``fixed_batch`` rows (``part`` padded with zeros); only ``part``'s rows come back."""
        n = part.shape[0]
        if n < self.fixed_batch:
            part = self._torch.cat([part, part.new_zeros((self.fixed_batch - n, *part.shape[1:]))])
        return _each(self.run(part), lambda o: o[:n])

    def scores(self, x):
        """(top-k scores float32 [N, k], their class ids int32 [N, k]) on the device, best first; every score of a row
        whose output holds NaN or infinity is NaN (its image becomes an error row)."""
        return self.answers(x)[:2]

    def answers(self, x):
        """``scores``' pair and the embedding (float32 [N, dim] on the device, L2-normalised where the spec says; a
        zero row stays zero), or None without one; a row whose embedding holds NaN or infinity scores NaN too.

        Raises:
            EngineError: the network returns no embedding, or one of another width than the spec's ``dim``.
        """
        torch = self._torch
        with torch.inference_mode():
            logits, features = split_outputs(self.run(x))
            out = logits.float()
            probs = out if self.probabilities else out.sigmoid() if self.sigmoid else out.softmax(dim=-1)
            top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
            # 0 * x is NaN exactly where x is NaN or infinite: summed over the classes, it spoils the whole row
            spoiled = (out * 0).sum(dim=-1, keepdim=True)
            embedding = None
            if self.embedding is not None:
                embedding = self._embedding(features, len(out))
                spoiled = spoiled + (embedding * 0).sum(dim=-1, keepdim=True)
                if self.embedding.normalize:
                    norm = embedding.norm(dim=-1, keepdim=True)
                    embedding = torch.where(norm == 0, torch.zeros_like(embedding), embedding / norm)
            return top.values + spoiled, top.indices.to(torch.int32), embedding

    def _embedding(self, features, rows: int):
        """The network's embedding output as float32 [rows, dim], its width checked against the spec's."""
        spec = self.embedding
        if features is None:
            raise EngineError(f"the model's spec declares the embedding {spec.output!r}, and its network returns only "
                              "its class output; return (logits, embedding) from the network, or remove "
                              '"embedding" from preprocess.json')
        features = features.float().reshape(rows, -1)
        if features.shape[1] != spec.dim:
            raise EngineError(f"the model's embedding {spec.output!r} is {features.shape[1]} wide and its spec says "
                              f"dim {spec.dim}; set embedding.dim to {features.shape[1]} in preprocess.json")
        return features

    def clear(self) -> None:
        self._graphs.clear()

    def _capture(self, size: int, like):
        torch = self._torch
        static_in = torch.zeros((size,) + tuple(like.shape[1:]), dtype=like.dtype, device=self.device)
        static_in = static_in.contiguous(memory_format=torch.channels_last)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # cudnn autotuning and lazy init happen outside the graph
                self.module(static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # thread_local: the preprocessing threads' CUDA calls must not invalidate this capture
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            static_out = self.module(static_in)
        self._graphs[size] = (g, static_in, static_out)
        LOG.info("captured a CUDA graph for batch %d", size)
        return self._graphs[size]


def _flat(out):
    """Every output of a network as one float32 vector per row (logits, then the embedding's values)."""
    import torch  # noqa: PLC0415

    parts = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([o.float().reshape(len(o), -1) for o in parts], dim=1)
