"""The Triton client's wire format: requests encoded as ModelInfer protobuf bytes directly, responses read from
their raw outputs (pipeline.triton.contract).

The client's CPU per image is what one actor process can send to its GPU. tritonclient's InferInput path copies
the files four times; a ModelInferRequest message with the files appended, three (the padded join, the message's
own copy, its serialization). ``encode_request`` writes the message's small fields with protobuf and appends the
two raw input fields itself, so the files are copied once, into the bytes gRPC sends
(``tests/benchmarks/bench_hop.py`` measures both against the same server).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pipeline.model.imaging import DecodeLimits
from pipeline.schema import MIB
from pipeline.triton import contract as tn

# Requests are padded to their longest file: cap the padded size so one big file does not make a 2 GB message.
MAX_REQUEST_BYTES = 64 * MIB


def _padded(blobs: Sequence[bytes], longest: int):
    """The files and the zero padding that brings each to ``longest`` bytes, as pieces to join."""
    for b in blobs:
        yield b
        if len(b) < longest:
            yield bytes(longest - len(b))


def plan_requests(sizes: Sequence[int], request_batch: int, max_request_bytes: int = MAX_REQUEST_BYTES) -> list[list[int]]:
    """Groups input indices into requests: similar sizes together (less padding), at most ``request_batch``
    images and ``max_request_bytes`` of padded tensor each (a single larger file still goes alone)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    requests: list[list[int]] = []
    current: list[int] = []
    for i in order:
        padded = (len(current) + 1) * max(sizes[i], 1)  # sorted: this one is the longest so far
        if current and (len(current) >= request_batch or padded > max_request_bytes):
            requests.append(current)
            current = []
        current.append(i)
    if current:
        requests.append(current)
    return requests


# ModelInferRequest's field 7, ``repeated bytes raw_input_contents``: tag byte (7 << 3 | length-delimited).
RAW_INPUT_TAG = bytes([7 << 3 | 2])


def request_header(model_name: str, n: int, longest: int, outputs: Sequence[str], limits: DecodeLimits):
    """A ModelInferRequest without its raw contents: IMAGE [n, longest] + LENGTH [n, 1] + TAG [n, 1], the outputs
    wanted, the caps as parameters."""
    from tritonclient.grpc import service_pb2  # noqa: PLC0415

    request = service_pb2.ModelInferRequest(model_name=model_name)
    request.inputs.add(name=tn.INPUT_IMAGE, datatype=tn.INPUTS[tn.INPUT_IMAGE], shape=[n, longest])
    request.inputs.add(name=tn.INPUT_LENGTH, datatype=tn.INPUTS[tn.INPUT_LENGTH], shape=[n, 1])
    request.inputs.add(name=tn.INPUT_TAG, datatype=tn.INPUTS[tn.INPUT_TAG], shape=[n, 1])
    for name in outputs:
        request.outputs.add(name=name)
    request.parameters[tn.PARAM_MAX_BYTES].int64_param = limits.max_bytes
    request.parameters[tn.PARAM_MAX_PIXELS].int64_param = limits.max_pixels
    return request


def encode_request(model_name: str, blobs: list[bytes], outputs: Sequence[str], limits: DecodeLimits,
                   tags: np.ndarray) -> bytes:
    """One ModelInferRequest, serialized: protobuf's bytes for the small fields, then the three raw input fields,
    the files copied once (rows zero-padded to the longest file), as protobuf would serialize the message.

    ``tags``: the request's TAG column (``pipeline.triton.contract.tags``), echoed back in ``ECHO``."""
    longest = max(1, max(len(b) for b in blobs))
    lengths = _lengths(blobs)
    tag_bytes = _tag_bytes(tags, len(blobs))
    return b"".join([request_header(model_name, len(blobs), longest, outputs, limits).SerializeToString(),
                     RAW_INPUT_TAG, _varint(len(blobs) * longest), *_padded(blobs, longest),
                     RAW_INPUT_TAG, _varint(len(lengths)), lengths,
                     RAW_INPUT_TAG, _varint(len(tag_bytes)), tag_bytes])


def _tag_bytes(tags: np.ndarray, n: int) -> bytes:
    if tags.size != n:
        raise ValueError(f"{n} images but {tags.size} tags")
    return np.ascontiguousarray(tags, dtype=np.int64).tobytes()


def _lengths(blobs: Sequence[bytes]) -> bytes:
    return np.array([len(b) for b in blobs], dtype=np.int32).tobytes()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def parse_response(response, n: int, has_error: bool, embeddings: Sequence[bool] = (False,)):
    """(each model's (class ids [n, K], scores [n, K], embeddings [n, dim] or None), widths [n], heights [n], error
    texts) of a ModelInferResponse; ``embeddings``: per model of the set (one by default), whether it answers one. A
    model set's models after the first answer in ``contract.set_output``'s outputs.

    Raises:
        AnswerMismatch: the response's outputs do not hold ``n`` rows (it cannot be this request's answer).
    """
    from tritonclient.utils import deserialize_bytes_tensor  # noqa: PLC0415

    raw = {out.name: response.raw_output_contents[i] for i, out in enumerate(response.outputs)}
    try:
        return _parsed(raw, n, has_error, embeddings, deserialize_bytes_tensor)
    except (KeyError, ValueError) as err:
        shapes = {out.name: list(out.shape) for out in response.outputs}
        raise AnswerMismatch(f"a response of {n} images has outputs {shapes} ({type(err).__name__}: {err})") from None


def check_answer(response, tags: np.ndarray) -> None:
    """Raises AnswerMismatch unless the response's ECHO column is exactly the request's ``tags``, row by row."""
    n = len(tags)
    echo = next((np.frombuffer(response.raw_output_contents[i], dtype=np.int64)
                 for i, out in enumerate(response.outputs) if out.name == tn.OUTPUT_ECHO), None)
    if echo is None or echo.size != n:
        raise AnswerMismatch(f"no {tn.OUTPUT_ECHO} of {n} rows in the response")
    wrong = (echo != tags.reshape(-1)).nonzero()[0]
    if wrong.size:
        first = int(wrong[0])
        raise AnswerMismatch(f"{wrong.size} of {n} rows answer other tags; row {first} answers {int(echo[first]):#x}, "
                             f"sent {int(tags[first, 0]):#x}")


class AnswerMismatch(Exception):
    """A response that is not the answer to the request it came back for (its ECHO or its shape is wrong)."""


def _parsed(raw: dict, n: int, has_error: bool, embeddings: Sequence[bool], deserialize_bytes_tensor):
    tops = [(np.frombuffer(raw[tn.set_output(tn.OUTPUT_CLASS_IDS, i)], dtype=np.int32).reshape(n, -1),
             np.frombuffer(raw[tn.set_output(tn.OUTPUT_SCORES, i)], dtype=np.float32).reshape(n, -1),
             np.frombuffer(raw[tn.set_output(tn.OUTPUT_EMBEDDING, i)], dtype=np.float32).reshape(n, -1) if has else None)
            for i, has in enumerate(embeddings)]
    widths = np.frombuffer(raw[tn.OUTPUT_WIDTH], dtype=np.int32).reshape(n)
    heights = np.frombuffer(raw[tn.OUTPUT_HEIGHT], dtype=np.int32).reshape(n)
    errors = deserialize_bytes_tensor(raw[tn.OUTPUT_ERROR]).reshape(n) if has_error and raw.get(tn.OUTPUT_ERROR) else [b""] * n
    texts = [e.decode("utf-8", errors="replace") if isinstance(e, bytes) else str(e) for e in errors]
    return tops, widths, heights, texts
