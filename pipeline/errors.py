"""Exception hierarchy: every message names the bad value and how to fix it."""


class BulkClassifyError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(BulkClassifyError):
    """A bad option or argument; raised before any work starts."""


class ModelError(BulkClassifyError):
    """A model folder, file or format that cannot be loaded."""


class GateFailed(ModelError):
    """The INT8 model fell below the gate (or the sample cannot judge it); no model was written.

    ``result`` is ``quantize_model``'s ``QuantizeResult``: the full report is at ``result.report_path``.
    """

    def __init__(self, message: str, result: object):
        super().__init__(message)
        self.result = result


class ParityFailed(ModelError):
    """The written folder does not classify like the source framework; nothing was kept."""


class SourceError(BulkClassifyError):
    """The source cannot be listed (missing, unreachable, no permission)."""


class EmptySourceError(SourceError):
    """The source holds no file the listing would classify."""


class OutputError(BulkClassifyError):
    """The destination cannot be written, or holds output of an incompatible run."""


class EngineError(BulkClassifyError):
    """An inference engine failed in a way no single input explains."""


class TritonError(EngineError):
    """The local tritonserver could not be found, started or reached."""


class ImageError(BulkClassifyError):
    """One input image cannot be classified; becomes that input's error row, never a crash.

    ``kind`` is a short stable code (see ``ERROR_KINDS``); ``str(err)`` is "kind: detail".
    """

    def __init__(self, kind: str, detail: str):
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown image error kind {kind!r}")
        self.kind = kind
        self.detail = detail
        super().__init__(f"{kind}: {detail}")


# The error kind of a folder or link the listing could not read: `_SUCCESS` and `report` count these rows apart.
LIST_ERROR = "list_error"
# Stable error codes: the first word of the `error` column, so users can group by them.
ERROR_KINDS = (
    "empty",  # zero bytes
    "too_large",  # encoded bytes over max_bytes
    "too_many_pixels",  # header says width*height over max_pixels (decompression bomb)
    "unsupported",  # not an image format we decode (text, random bytes)
    "decode_error",  # recognised format but the data is corrupt/truncated
    "fetch_error",  # the object could not be read from storage (after retries)
    "not_found",  # the object vanished between listing and fetch
    "permission_denied",  # storage refused access to the object
    "engine_error",  # the engine failed on this input alone (isolated by splitting)
    LIST_ERROR,  # the listing could not read this folder or link (permissions, a loop, a link out of the source)
)
