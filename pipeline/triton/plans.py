"""TensorRT plans of the production profile, keyed by GPU architecture and TensorRT version: built where TensorRT's
builder is, found (or refused, naming what is there) where a server loads them."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ModelError
from pipeline.triton.contract import VERSION

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanKey:
    """What a TensorRT plan is tied to: the GPU's compute capability and the exact TensorRT version."""

    compute_capability: str  # "9.0"
    tensorrt: str  # "10.3.0"

    @property
    def filename(self) -> str:
        """e.g. model.sm90.trt10.3.plan (major.minor in the name; the JSON beside it holds the full version)."""
        sm = self.compute_capability.replace(".", "")
        major_minor = ".".join(self.tensorrt.split(".")[:2])
        return f"model.sm{sm}.trt{major_minor}.plan"

    @property
    def json_filename(self) -> str:
        return self.filename[: -len(".plan")] + ".json"


def local_plan_key() -> PlanKey | None:
    """The key of this machine (first GPU, installed TensorRT), or None where either is missing."""
    version = None
    for module in ("tensorrt", "tensorrt_lean"):
        try:
            version = __import__(module).__version__
            break
        except ImportError:
            continue
    if version is None or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    caps = out.split()
    return PlanKey(caps[0], version) if caps else None


def write_plan_key(model_dir: Path, key: PlanKey, **extra) -> Path:
    path = Path(model_dir) / VERSION / key.json_filename
    path.write_text(json.dumps({"compute_capability": key.compute_capability, "tensorrt": key.tensorrt, **extra},
                               indent=2) + "\n", encoding="utf-8")
    return path


def find_plan(model_dir: Path, key: PlanKey) -> Path:
    """The plan built for ``key`` in a classifier_trt folder; ModelError saying what was found otherwise.

    TensorRT plans only load on the GPU architecture and TensorRT version they were built with; failing here
    gives a clear message instead of the backend's deserialization error.
    """
    version_dir = Path(model_dir) / VERSION
    found = []
    for meta in sorted(version_dir.glob("model.sm*.trt*.json")):
        try:
            data = json.loads(meta.read_text(encoding="utf-8"))
            other = PlanKey(str(data["compute_capability"]), str(data["tensorrt"]))
        except (ValueError, KeyError) as err:
            raise ModelError(f"{meta} is not a plan key file ({err}); rebuild the repository") from None
        plan = version_dir / other.filename
        if other == key and plan.is_file():
            return plan
        found.append(f"sm{other.compute_capability} TensorRT {other.tensorrt}")
    raise ModelError(
        f"{version_dir} has no TensorRT plan for this machine (compute capability {key.compute_capability}, "
        f"TensorRT {key.tensorrt}); it has: {', '.join(found) or 'none'}. Plans only load where they were built: "
        "run `bulk-classify repo build --profile production` in the worker image on this GPU type"
    )


def build_trt_plan(onnx_path: Path, model_dir: Path, spec, *, max_batch_size: int) -> PlanKey | None:
    """Builds an FP16 plan with a dynamic batch profile (1, max, max) where TensorRT's builder is installed."""
    key = local_plan_key()
    try:
        import tensorrt as trt  # noqa: PLC0415 - the builder exists in the worker image only
    except ImportError:
        LOG.warning("TensorRT's builder is not installed here: no plan built; run `bulk-classify repo build "
                    "--profile production` in the worker image (NVIDIA's Triton container) to add it")
        return None
    if key is None:
        LOG.warning("no GPU found (nvidia-smi): no TensorRT plan built")
        return None
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from the file: its external data is read from beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ModelError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    shape = tuple(spec.input_shape)
    profile.set_shape(network.get_input(0).name, (1, *shape), (max_batch_size, *shape), (max_batch_size, *shape))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ModelError(f"TensorRT failed to build a plan from {onnx_path}; see its log above")
    (Path(model_dir) / VERSION / key.filename).write_bytes(bytes(serialized))
    write_plan_key(model_dir, key, precision="fp16", batch_profile=[1, max_batch_size, max_batch_size],
                   onnx_sha256=hashlib.sha256(Path(onnx_path).read_bytes()).hexdigest())
    return key
