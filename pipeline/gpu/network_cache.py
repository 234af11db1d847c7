"""Users' networks converted for the GPU paths once per model and node: the checked conversion on disk, and per card
the precision gate's verdict and torch.compile's artifacts.

Converting a ``model.onnx`` and checking it against ONNX Runtime takes seconds to a minute, and every GPU instance of
every run needs the same network, so the checked conversion (``onnx_torch.convert_checked``) is kept under
``<cache>/gpu-networks/<key>/`` (the cache of ``pipeline.model.folder.default_cache_dir``). The key covers everything
the conversion's result depends on: the ONNX file's bytes (and its external data), the preprocessing spec (its
embedding declaration too, which decides the converted graph's outputs), the
fixed batch, the versions of torch, onnx, onnx2torch, onnxslim and ONNX Runtime, and the source of the conversion code
itself, so a changed model, library or converter never finds an old entry. What depends on the card (the gate's
verdict, inductor's kernels) lives below the entry in ``cards/<card key>/``, keyed by the GPU's name and compute
capability, torch, CUDA and Triton, the way TensorRT engines are keyed by GPU and runtime.

An entry is written to a temporary folder and renamed into place, its files' sha256 recorded in ``entry.json``; a
process building it holds a lock, so the instances of a node wait for one conversion instead of each doing it. An
entry whose record, key or files do not match is removed and rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from pipeline.model import onnx_graph
from pipeline.model.default_model import file_sha256
from pipeline.model.folder import BUILD_LOCK_TIMEOUT_S, default_cache_dir, external_data_files

LOG = logging.getLogger(__name__)

CACHE_FOLDER = "gpu-networks"
ENTRY_FILE = "entry.json"
NETWORK_FILE = "network.pt"
REFERENCE_FILE = "reference.npz"
GATE_FILE = "gate.json"
INDUCTOR_FOLDER = "inductor"
ENTRY_FORMAT = 1  # the layout of an entry's files
KEY_LIBRARIES = ("torch", "onnx", "onnx2torch", "onnxslim", "onnxruntime")
# The modules whose code decides a conversion: their source is part of the key (named by path, so that the driver
# can find an entry without importing torch).
CODE_FILES = (Path(__file__).with_name("onnx_torch.py"), Path(onnx_graph.__file__), Path(__file__))


@dataclass(frozen=True)
class CachedNetwork:
    """A checked conversion and where it came from."""

    conversion: Any  # onnx_torch.Conversion
    entry: Path  # the entry's folder
    from_cache: bool  # found on disk (False: converted by this call)
    seconds: float  # to load it, or to convert, check and write it


def library_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def entry_key(onnx_path: str | Path, spec, fixed_batch: int | None) -> tuple[str, dict[str, Any]]:
    """The cache key of a conversion (sha256 hex) and the fields it hashes."""
    import onnx  # noqa: PLC0415

    path = Path(onnx_path)
    data = external_data_files(onnx.load(str(path), load_external_data=False), path)
    code = hashlib.sha256(b"".join(p.read_bytes() for p in CODE_FILES)).hexdigest()
    fields = {"format": ENTRY_FORMAT, "onnx_sha256": [file_sha256(path)] + [file_sha256(path.parent / n) for n in data],
              "spec": spec.to_json(), "fixed_batch": fixed_batch, "code_sha256": code,
              **{name: library_version(name) for name in KEY_LIBRARIES}}
    return _sha(fields), fields


def cache_root(root: str | Path | None = None) -> Path:
    return Path(root) if root is not None else default_cache_dir() / CACHE_FOLDER


def find_entry(onnx_path: str | Path, spec, *, fixed_batch: int | None = None,
               root: str | Path | None = None) -> dict[str, Any] | None:
    """The record of a whole, matching cache entry for this conversion, or None; reads no network (and imports no
    torch), so the driver of a run whose model was checked before starts at once."""
    key, fields = entry_key(onnx_path, spec, fixed_batch)
    entry = cache_root(root) / key[:32]
    try:
        record = json.loads((entry / ENTRY_FILE).read_text(encoding="utf-8"))
        if record.get("key") != fields:
            return None
        if any(file_sha256(entry / name) != want for name, want in record["files"].items()):
            return None
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    return record


def checked_network(onnx_path: str | Path, spec, *, fixed_batch: int | None = None,
                    root: str | Path | None = None) -> CachedNetwork:
    """The checked conversion of ``onnx_path``: from its cache entry where one is whole and matches, else converted
    and checked (``onnx_torch.convert_checked``) and written, once per node (other processes wait for the lock).

    Raises:
        ModelError: the conversion fails or does not agree with ONNX Runtime (nothing is written).
    """
    started = time.perf_counter()
    key, fields = entry_key(onnx_path, spec, fixed_batch)
    base = cache_root(root)
    base.mkdir(parents=True, exist_ok=True)
    entry = base / key[:32]
    found = _load(entry, fields)
    if found is not None:
        return CachedNetwork(found, entry, True, time.perf_counter() - started)
    with FileLock(str(base / f"{key[:32]}.lock"), timeout=BUILD_LOCK_TIMEOUT_S):
        found = _load(entry, fields)  # another process may have written it while this one waited
        if found is not None:
            return CachedNetwork(found, entry, True, time.perf_counter() - started)
        from pipeline.gpu import onnx_torch  # noqa: PLC0415 - torch and onnx2torch: the gpu extra

        conversion = onnx_torch.convert_checked(onnx_path, spec, fixed_batch=fixed_batch)
        _write(entry, fields, conversion)
        LOG.info("converted %s for the GPU paths (%s; %s) in %.1f s; cached in %s", onnx_path, conversion.note,
                 conversion.agreement.describe(), time.perf_counter() - started, entry)
        return CachedNetwork(conversion, entry, False, time.perf_counter() - started)


def _load(entry: Path, fields: dict[str, Any]):
    """The entry's conversion (``onnx_torch.Conversion``), or None where there is none; an entry that does not match
    is removed."""
    record_path = entry / ENTRY_FILE
    if not record_path.is_file():
        return None
    import torch  # noqa: PLC0415

    from pipeline.gpu import onnx_torch  # noqa: PLC0415 - torch and onnx2torch: the gpu extra

    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        if record.get("key") != fields:
            raise ValueError("its key fields differ")
        for name, want in record["files"].items():
            if file_sha256(entry / name) != want:
                raise ValueError(f"{name} does not match its recorded sha256")
        with np.load(entry / REFERENCE_FILE) as saved:
            inputs, outputs = saved["inputs"], saved["outputs"]
            embeddings = saved["embeddings"] if "embeddings" in saved.files else None
        # The entry is this node's own, written by this code (its sha256 checked above): not a foreign pickle.
        network = torch.load(entry / NETWORK_FILE, map_location="cpu", weights_only=False)
        reference = onnx_torch.OnnxReference(inputs, outputs, bool(record["probabilities"]), fields["fixed_batch"],
                                             embeddings)
        agreement = onnx_torch.Agreement(**record["agreement"])
        return onnx_torch.Conversion(network.eval(), reference, agreement, record["note"])
    except Exception as err:  # noqa: BLE001 - any damage (truncated, foreign, stale): rebuild, never trust it
        LOG.warning("the cached GPU network in %s is not usable (%s: %s); converting again", entry,
                    type(err).__name__, str(err)[:200])
        _remove(entry)
        return None


def _write(entry: Path, fields: dict[str, Any], conversion) -> None:
    import torch  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        torch.save(conversion.network, tmp / NETWORK_FILE)
        reference = conversion.reference
        arrays = {"inputs": reference.inputs, "outputs": reference.outputs}
        if reference.embeddings is not None:
            arrays["embeddings"] = reference.embeddings
        np.savez(tmp / REFERENCE_FILE, **arrays)
        record = {"key": fields, "note": conversion.note, "agreement": asdict(conversion.agreement),
                  "probabilities": conversion.reference.probabilities,
                  "files": {name: file_sha256(tmp / name) for name in (NETWORK_FILE, REFERENCE_FILE)}}
        (tmp / ENTRY_FILE).write_text(json.dumps(record, indent=1), encoding="utf-8")
        if entry.exists():  # a damaged entry _load could not remove
            _remove(entry)
        os.rename(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove(entry: Path) -> None:
    """Moves a bad entry aside first (a rename is atomic), so no reader sees half of it."""
    if not entry.exists():
        return
    trash = entry.parent / f".trash-{entry.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def card_fields(torch, device) -> dict[str, Any]:
    """What a card's results depend on: the GPU's name and compute capability, torch, CUDA and Triton (inductor's
    kernels compile with it)."""
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": library_version("triton")}


def card_folder(entry: Path, torch, device) -> Path:
    """The entry's folder for results on ``device``'s kind of card (made if missing)."""
    return card_folder_for(entry, card_fields(torch, device))


def card_folder_for(entry: Path, fields: dict[str, Any]) -> Path:
    """The entry's folder for results on the kind of card ``fields`` describes (made if missing)."""
    folder = entry / "cards" / _sha(fields)[:16]
    folder.mkdir(parents=True, exist_ok=True)
    card = folder / "card.json"
    if not card.is_file():
        _write_json(card, fields)
    return folder


def use_compile_cache(folder: Path) -> bool:
    """Makes torch.compile keep its artifacts (inductor's FX graphs, kernels, autotuning) in ``folder``, so a later
    process compiling the same network on the same kind of card reuses them; True where some are there already."""
    cache = folder / INDUCTOR_FOLDER
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return cache.is_dir() and any(cache.iterdir())


def read_gate(folder: Path) -> dict[str, Any] | None:
    """The precision gate's verdict recorded for this card, or None (absent or unreadable)."""
    try:
        found = json.loads((folder / GATE_FILE).read_text(encoding="utf-8"))
        return found if isinstance(found.get("half"), bool) else None
    except (OSError, ValueError, AttributeError):
        return None


def write_gate(folder: Path, verdict: dict[str, Any]) -> None:
    _write_json(folder / GATE_FILE, verdict)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _sha(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
