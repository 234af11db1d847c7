"""config.pbtxt of every repository profile (portable, production, gpu), generated from the tensor contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipeline.errors import ConfigError
from pipeline.gpu.defaults import DALI_THREADS, GPU_DEFAULT_MAX_DELAY_MS, GPU_DEFAULT_PREP_WORKERS
from pipeline.schema import DEFAULT_TOP_K
from pipeline.triton import contract as tn

DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_PORTABLE_INSTANCES = 1
PRODUCTION_TRT_INSTANCES = 2
QUEUE_DELAY_US = 2000
PLAN_DEFAULT = "model.plan"
GPU_MAX_BATCH_SIZE = 1024  # images per request at most; the model's stream cuts them into batch_size network calls
# Stub processes per GPU, each with its own request stream (pipeline.gpu.stream), classifier and CUDA
# context: in one process DALI and the network take turns on the GPU, several keep it busy (docs/performance.md).
GPU_INSTANCES = 3
GPU_QUEUE_DELAY_US = 100
# The network batch of the gpu profile's model (the gpu engine in process keeps GPU_DEFAULT_BATCH_SIZE, in
# pipeline.gpu.defaults): smaller batches from several instances under MPS keep the GPU busier than one instance's
# large ones.
GPU_TRITON_BATCH_SIZE = 128
# Batches' worth of images a model instance takes before its execute() waits, so that the server
# hands the next requests to an instance with less work (pipeline.gpu.stream; 0: never waits); with it more
# instances pay under MPS.
GPU_MAX_BACKLOG = 6
HALF_CHOICES = ("auto", "true", "false")


@dataclass(frozen=True, kw_only=True)
class GpuModelOptions:
    """How the gpu profile's served model is built (``gpu_config``).

    Attributes:
        top_k: classes per image the model returns.
        max_batch_size: images per request at most.
        batch_size: the network batch inside one execute(); None: GPU_TRITON_BATCH_SIZE.
        network: "auto" (the version folder's model, else the default), or a network the served code knows.
        cuda_graph: replay the network as a CUDA graph.
        queue_delay_us: how long the dynamic batcher waits for a fuller batch.
        error_output: declare the optional BYTES ``ERROR`` output (None: where numpy can send it, ``declares_error``);
            without it a request holding a bad image fails as a whole and the client isolates it.
        prep_workers, dali_depth, dali_threads, hw_decoder_load, cuda_sync: the preparing side's settings (None:
            the model's default).
        half: "auto", "true" or "false": the network's precision.
        cudnn_autotune: let cuDNN time its algorithms for each conv at each instance's first batch; None: the served
            model's default (``pipeline.triton.serve.gpu_model.SERVED_CUDNN_AUTOTUNE``).
        instances: model instances; None: GPU_INSTANCES.
        max_delay_ms: the longest wait for a fuller network batch.
        max_backlog: network batches' worth of images one instance takes before its ``execute()`` waits (0: never),
            so the server hands the next requests to the other instances (``pipeline.gpu.stream``).

    Raises:
        ConfigError: an unknown ``half`` or a negative ``max_backlog``.
    """

    top_k: int = DEFAULT_TOP_K
    max_batch_size: int = GPU_MAX_BATCH_SIZE
    batch_size: int | None = None
    network: str = "auto"
    cuda_graph: bool = True
    queue_delay_us: int = GPU_QUEUE_DELAY_US
    error_output: bool | None = None
    prep_workers: int = GPU_DEFAULT_PREP_WORKERS
    dali_depth: int | None = None
    dali_threads: int | None = None
    hw_decoder_load: float | None = None
    half: str = "auto"
    cudnn_autotune: bool | None = None
    cuda_sync: str | None = None
    instances: int | None = None
    max_delay_ms: float = GPU_DEFAULT_MAX_DELAY_MS
    max_backlog: float = GPU_MAX_BACKLOG

    def __post_init__(self) -> None:
        object.__setattr__(self, "half", str(self.half).lower())
        if self.half not in HALF_CHOICES:
            raise ConfigError(f"half {self.half!r} is unknown; use auto, true or false")
        if self.max_backlog < 0:
            raise ConfigError(f"max_backlog={self.max_backlog} must be 0 (never wait) or more network batches, e.g. 6")


def model_config():
    """Triton's ``model_config_pb2`` module."""
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415 - protobuf import is slow; only when needed

    return model_config_pb2


def triton_dtype(name: str) -> int:
    """The config's data type of a contract dtype (``BYTES`` is ``TYPE_STRING``)."""
    return model_config().DataType.Value("TYPE_STRING" if name == "BYTES" else f"TYPE_{name}")


def _tensor(kind, name: str, dtype: str, dims) -> None:
    kind.add(name=name, data_type=triton_dtype(dtype), dims=list(dims))


def _contract_inputs(config) -> None:
    for name, dtype in tn.INPUTS.items():
        _tensor(config.input, name, dtype, [-1] if name == tn.INPUT_IMAGE else [1])


def _contract_io(config, k: int, *, with_error: bool, set_top_k: Sequence[int] = (),
                 embedding_dims: Sequence[int | None] = ()) -> None:
    """The contract's inputs and outputs, and a model set's (``tn.set_output``): CLASS_IDS_i and SCORES_i of each model
    after the first (``set_top_k``: their k), EMBEDDING(_i) of each model with a width in ``embedding_dims``."""
    _contract_inputs(config)
    outputs = [(name, dtype, k if name in (tn.OUTPUT_CLASS_IDS, tn.OUTPUT_SCORES) else 1)
               for name, dtype in tn.OUTPUTS.items() if name != tn.OUTPUT_ERROR or with_error]
    outputs += [(tn.set_output(name, i), tn.OUTPUTS[name], k)
                for i, k in enumerate(set_top_k, 1) for name in tn.SET_OUTPUTS]
    outputs += [(tn.set_output(tn.OUTPUT_EMBEDDING, i), tn.EMBEDDING_DTYPE, d)
                for i, d in enumerate(embedding_dims) if d]
    for name, dtype, width in outputs:
        _tensor(config.output, name, dtype, [width])


def _place(config, kind: str, instances: int, queue_delay_us: int) -> None:
    """``instances`` on ``kind`` (CPU, GPU), the dynamic batcher waiting ``queue_delay_us`` for a fuller batch."""
    config.instance_group.add(kind=model_config().ModelInstanceGroup.Kind.Value(f"KIND_{kind}"), count=instances)
    config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us


def _text(config) -> str:
    from google.protobuf import text_format  # noqa: PLC0415

    return text_format.MessageToString(config)


def declares_error(error_output: bool | None) -> bool:
    """Whether a python model declares ``ERROR``: ``error_output``, else whether numpy here can send BYTES tensors (the
    wheel's python backend sends them empty when its Python has numpy 2, docs/engines.md)."""
    import numpy as np  # noqa: PLC0415

    return int(np.__version__.split(".")[0]) < 2 if error_output is None else error_output


def portable_config(*, top_k: int = DEFAULT_TOP_K, instances: int = DEFAULT_PORTABLE_INSTANCES,
                    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, error_output: bool | None = None,
                    set_top_k: Sequence[int] = (), embedding_dims: Sequence[int | None] = ()) -> str:
    """config.pbtxt of the portable profile's one model (python backend, CPU).

    ``error_output``: declare the BYTES ``ERROR`` output (None: ``declares_error``); ``set_top_k``, ``embedding_dims``:
    a model set's k of each model after the first and each model's embedding width or None (``_contract_io``).
    """
    config = model_config().ModelConfig(name=tn.MODEL_NAME, backend="python", max_batch_size=max_batch_size)
    _contract_io(config, top_k, with_error=declares_error(error_output), set_top_k=set_top_k,
                 embedding_dims=embedding_dims)
    _place(config, "CPU", instances, QUEUE_DELAY_US)
    return _text(config)


def production_configs(spec, *, onnx_input: str, top_k: int = DEFAULT_TOP_K,
                       max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                       plans: dict[str, str] | None = None) -> dict[str, str]:
    """config.pbtxt of each production model: DALI preprocess, TensorRT classifier, and the ensemble joining them.

    ``plans`` maps a compute capability ("9.0") to the plan file built for it (Triton's cc_model_filenames).
    """
    mc = model_config()
    pre = mc.ModelConfig(name=tn.PREPROCESS_MODEL, backend="dali", max_batch_size=max_batch_size)
    _contract_inputs(pre)
    _tensor(pre.output, tn.PREPROCESSED, "FP32", spec.input_shape)
    for name in (tn.OUTPUT_WIDTH, tn.OUTPUT_HEIGHT, tn.OUTPUT_ECHO):  # the DALI graph passes TAG through as ECHO
        _tensor(pre.output, name, tn.OUTPUTS[name], [1])
    _place(pre, "GPU", 1, QUEUE_DELAY_US)
    pre.parameters["num_threads"].string_value = str(DALI_THREADS)

    trt = mc.ModelConfig(name=tn.CLASSIFIER_TRT_MODEL, platform="tensorrt_plan", max_batch_size=max_batch_size)
    _tensor(trt.input, onnx_input, "FP32", spec.input_shape)
    _tensor(trt.output, tn.OUTPUT_SCORES, "FP32", [top_k])
    _tensor(trt.output, tn.OUTPUT_CLASS_IDS, "INT32", [top_k])
    _place(trt, "GPU", PRODUCTION_TRT_INSTANCES, QUEUE_DELAY_US)
    # The plan's optimisation profile is tuned for max_batch_size (see build_trt_plan): batch to exactly that.
    trt.dynamic_batching.preferred_batch_size.append(max_batch_size)
    trt.default_model_filename = PLAN_DEFAULT
    for cc, filename in sorted((plans or {}).items()):
        trt.cc_model_filenames[cc] = filename

    ens = mc.ModelConfig(name=tn.MODEL_NAME, platform="ensemble", max_batch_size=max_batch_size)
    _contract_io(ens, top_k, with_error=False)
    pre_outputs = (tn.PREPROCESSED, tn.OUTPUT_WIDTH, tn.OUTPUT_HEIGHT, tn.OUTPUT_ECHO)
    for model, inputs, outputs in ((tn.PREPROCESS_MODEL, {n: n for n in tn.INPUTS}, pre_outputs),
                                   (tn.CLASSIFIER_TRT_MODEL, {onnx_input: tn.PREPROCESSED},
                                    (tn.OUTPUT_SCORES, tn.OUTPUT_CLASS_IDS))):
        step = ens.ensemble_scheduling.step.add(model_name=model, model_version=-1, input_map=inputs)
        step.output_map.update({name: name for name in outputs})
    return {tn.PREPROCESS_MODEL: _text(pre), tn.CLASSIFIER_TRT_MODEL: _text(trt), tn.MODEL_NAME: _text(ens)}


def gpu_config(options: GpuModelOptions = GpuModelOptions(), *, set_top_k: Sequence[int] = (),
               embedding_dims: Sequence[int | None] = ()) -> str:
    """config.pbtxt of the gpu profile's one model (python backend, KIND_GPU, ragged IMAGE input); ``set_top_k`` and
    ``embedding_dims``: a model set's, as ``portable_config``'s."""
    o = options
    instances = GPU_INSTANCES if o.instances is None else o.instances
    batch_size = GPU_TRITON_BATCH_SIZE if o.batch_size is None else o.batch_size
    config = model_config().ModelConfig(name=tn.MODEL_NAME, backend="python", max_batch_size=o.max_batch_size)
    _contract_io(config, o.top_k, with_error=declares_error(o.error_output), set_top_k=set_top_k,
                 embedding_dims=embedding_dims)
    # Requests padded to different lengths can then share one execute() (the backend sees each request).
    next(t for t in config.input if t.name == tn.INPUT_IMAGE).allow_ragged_batch = True
    _place(config, "GPU", instances, o.queue_delay_us)
    _set_parameters(config, {
        **prep_parameters(o, batch_size),
        tn.GPU_PARAM_CUDA_GRAPH: "true" if o.cuda_graph else "false",
        tn.GPU_PARAM_MAX_DELAY_MS: o.max_delay_ms,
        tn.PARAM_CHECKS_CAPS: "true",  # triage checks both caps on every image (pipeline.gpu.classifier)
        tn.GPU_PARAM_HALF: None if o.half == "auto" else o.half,
        tn.GPU_PARAM_CUDNN_AUTOTUNE: None if o.cudnn_autotune is None else str(bool(o.cudnn_autotune)).lower(),
        tn.GPU_PARAM_MAX_BACKLOG: f"{o.max_backlog:g}",
    })
    return _text(config)


def prep_parameters(o: GpuModelOptions, batch_size: int) -> dict:
    """The parameters of a served model that prepares images: its network, batch and the preparing side's settings."""
    return {
        tn.GPU_PARAM_NETWORK: o.network,
        tn.GPU_PARAM_BATCH_SIZE: batch_size,
        tn.GPU_PARAM_PREP_WORKERS: o.prep_workers,
        tn.GPU_PARAM_HW_DECODER_LOAD: o.hw_decoder_load,
        tn.GPU_PARAM_DALI_DEPTH: o.dali_depth,
        tn.GPU_PARAM_DALI_THREADS: o.dali_threads,
        tn.GPU_PARAM_CUDA_SYNC: o.cuda_sync,
    }


def _set_parameters(config, params: dict) -> None:
    """A model config's string parameters; a None value leaves that parameter out (the model's default)."""
    for key, value in params.items():
        if value is not None:
            config.parameters[key].string_value = str(value)
