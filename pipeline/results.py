"""The per-image result every engine returns, and the engine interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

STATUS_OK = "ok"
STATUS_ERROR = "error"


@dataclass
class Result:
    """One input's outcome. Scores are softmax probabilities, descending."""

    status: str
    error: str | None = None
    class_ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    width: int | None = None
    height: int | None = None

    @classmethod
    def failed(cls, error: str, width: int | None = None, height: int | None = None) -> "Result":
        return cls(status=STATUS_ERROR, error=error, width=width, height=height)


class Engine(Protocol):
    """What every engine (onnx, triton, gpu) offers: one Result per encoded image, in order."""

    name: str

    def classify(self, images: Sequence[bytes]) -> list[Result]: ...

    def close(self) -> None: ...
