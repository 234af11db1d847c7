"""Tensor and model names of the Triton contract, shared by every repository profile, its checks and the engine.

Every profile (``production``: DALI + TensorRT ensemble, ``portable``: python backend + ONNX Runtime,
``gpu``: the GPU engineer's) serves one model named ``MODEL_NAME`` with these inputs and outputs, so the
Triton engine does not care which one answers. All tensors are batched (``max_batch_size > 0``); the dims
below are per image, without the batch dimension.

Inputs:
    IMAGE   UINT8 [-1]  the encoded file as it is (JPEG/PNG/...), zero-padded to the longest in the request.
    LENGTH  INT32 [1]   the number of real bytes in IMAGE; the padding after it is ignored.
    TAG     INT64 [1]   the client's name for this image: its request's id and its index in the request (``tags``).

Outputs:
    CLASS_IDS  INT32 [K]  top-K class indices, best first (K is fixed when the repository is built).
    SCORES     FP32  [K]  their softmax probabilities, descending.
    WIDTH      INT32 [1]  decoded width in pixels, EXIF orientation applied (0 when the image failed).
    HEIGHT     INT32 [1]  decoded height in pixels, EXIF orientation applied (0 when the image failed).
    ECHO       INT64 [1]  the TAG of the image this row answers, carried with the image through the model, so the
                          client can check that every answer is its own image's (a mismatch is retried).
    ERROR      BYTES [1]  "" when the image was classified, else "kind: detail" (kinds in pipeline.errors).
                          Optional: a profile that cannot report per image (DALI fails a whole batch) omits
                          it, and the engine isolates a bad input by splitting the failed request.

A model set (``--model NAME=DIR`` more than once) is one served model: its first model answers in the outputs above,
model ``i`` of the rest (1, 2, ...) in ``CLASS_IDS_i`` and ``SCORES_i`` (``set_output``), each image decoded once and
every model's own preprocessing and network run on that decode; ``ERROR``, ``WIDTH`` and ``HEIGHT`` are the image's.
A model whose spec declares an embedding also answers ``EMBEDDING`` (``EMBEDDING_i``): FP32 [dim], L2-normalised
where the spec says.

Why padded UINT8 + LENGTH rather than BYTES: the DALI backend takes numeric tensors only, and one wire
format for every profile keeps the engine profile-agnostic.
"""

MODEL_NAME = "classifier"
VERSION = "1"  # the one version folder of every model in a repository

INPUT_IMAGE = "IMAGE"
INPUT_LENGTH = "LENGTH"
INPUT_TAG = "TAG"

OUTPUT_CLASS_IDS = "CLASS_IDS"
OUTPUT_SCORES = "SCORES"
OUTPUT_WIDTH = "WIDTH"
OUTPUT_HEIGHT = "HEIGHT"
OUTPUT_ERROR = "ERROR"
OUTPUT_ECHO = "ECHO"

# Internal tensors of the production ensemble (preprocess -> classifier_trt -> postprocess inside the plan).
PREPROCESS_MODEL = "preprocess"
CLASSIFIER_TRT_MODEL = "classifier_trt"
PREPROCESSED = "PREPROCESSED"  # FP32 [3, H, W] (NCHW per the model's PreprocessSpec)

# Triton dtype strings (config.pbtxt uses TYPE_<dtype>; the client uses the bare name).
INPUTS = {INPUT_IMAGE: "UINT8", INPUT_LENGTH: "INT32", INPUT_TAG: "INT64"}
OUTPUTS = {
    OUTPUT_CLASS_IDS: "INT32",
    OUTPUT_SCORES: "FP32",
    OUTPUT_WIDTH: "INT32",
    OUTPUT_HEIGHT: "INT32",
    OUTPUT_ECHO: "INT64",
    OUTPUT_ERROR: "BYTES",
}
REQUIRED_OUTPUTS = (OUTPUT_CLASS_IDS, OUTPUT_SCORES, OUTPUT_WIDTH, OUTPUT_HEIGHT, OUTPUT_ECHO)
# A model's embedding, where its spec declares one (FP32 [dim]).
OUTPUT_EMBEDDING = "EMBEDDING"
EMBEDDING_DTYPE = "FP32"
# The outputs of each model after a set's first (``set_output``); its files are in SET_FOLDER of the version folder.
SET_OUTPUTS = (OUTPUT_CLASS_IDS, OUTPUT_SCORES)
SET_FOLDER = "model_{index}"
# A TAG is (request id << TAG_INDEX_BITS) | the image's index in its request; requests hold fewer images than this.
TAG_INDEX_BITS = 24

# The gpu profile's config.pbtxt `parameters` (string values, also accepted as request parameters), written by
# pipeline.triton.configs and read by the gpu profile's models.
GPU_PARAM_NETWORK = "network"  # "auto" (the version folder's model, else the default), or a "module:function"
GPU_PARAM_HW_DECODER_LOAD = "hw_decoder_load"  # DALI: share of a batch for the hardware JPEG engines
GPU_PARAM_BATCH_SIZE = "batch_size"
GPU_PARAM_CUDA_GRAPH = "cuda_graph"
GPU_PARAM_PREP_WORKERS = "prep_workers"
GPU_PARAM_DALI_DEPTH = "dali_depth"  # DALI: batches in flight on one pipeline (1: a pipeline per preparing thread)
GPU_PARAM_DALI_THREADS = "dali_threads"  # DALI: CPU threads per pipeline
GPU_PARAM_CUDA_SYNC = "cuda_sync"  # how the model's threads wait for the GPU: one of pipeline.gpu.defaults' modes
# Batches' worth of images one model instance holds before its execute() waits (so the server gives the next
# requests to another instance); "0": never waits.
GPU_PARAM_MAX_BACKLOG = "max_backlog"
GPU_PARAM_HALF = "half"  # "auto": FP16 on a GPU, FP32 on the CPU; "true" or "false"
GPU_PARAM_CUDNN_AUTOTUNE = "cudnn_autotune"  # "true": cuDNN times its algorithms for each conv at the first batch
# The caps: config.pbtxt parameters of every python-backend model and request parameters the engine sends.
PARAM_MAX_BYTES = "max_bytes"
PARAM_MAX_PIXELS = "max_pixels"
# A model that checks max_bytes/max_pixels per image itself (request parameters) says so; the engine then skips
# its own header check of every file.
PARAM_CHECKS_CAPS = "checks_caps"
GPU_PARAM_MAX_DELAY_MS = "max_delay_ms"  # queued images wait this long for a full network batch while the GPU idles
# A served model's log line that says what its start took; TritonServer repeats each in the run's log once ready.
START_REPORT = "start report: "


def set_output(name: str, index: int) -> str:
    """The output ``name`` (one of SET_OUTPUTS, or OUTPUT_EMBEDDING) of a model set's model ``index`` (0: the first,
    the contract's own names)."""
    return name if index == 0 else f"{name}_{index}"


def failure_message(errors: list[str], n: int) -> str:
    """The error of a request that fails because some of its ``n`` images did (a model without the ``ERROR``
    output): the one image's error, or how many failed and the first; the client then isolates the bad files."""
    return errors[0] if n == 1 else f"{len(errors)} of {n} images failed; first: {errors[0]}"


def tags(request_id: int, n: int):
    """The TAG column (INT64 [n, 1]) of request ``request_id``'s ``n`` images."""
    import numpy as np  # noqa: PLC0415 - this module is imported by configs that need no numpy

    if not 0 < n <= 1 << TAG_INDEX_BITS:
        raise ValueError(f"a request holds 1 to {1 << TAG_INDEX_BITS} images, not {n}")
    return ((np.int64(request_id) << TAG_INDEX_BITS) + np.arange(n, dtype=np.int64)).reshape(n, 1)
