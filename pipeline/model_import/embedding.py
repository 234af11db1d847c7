"""A network's embedding for ``model import --embedding``: torch modules that return (logits, the pooled pre-logits
features), the features read where each framework computes them (timm's ``forward_head(pre_logits=True)``; the input
of the final Linear for torchvision and Hugging Face)."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.errors import ModelError


class TimmEmbedder(torch.nn.Module):
    """A timm network as (logits, ``forward_head(features, pre_logits=True)``), the features computed once."""

    def __init__(self, network: Any):
        super().__init__()
        self.network = network

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.network.forward_features(x)
        return self.network.forward_head(features), self.network.forward_head(features, pre_logits=True)


class HeadInputEmbedder(torch.nn.Module):
    """A classifier as (logits, the input of its final Linear layer): the layer that maps the pooled features to the
    ``classes`` logits, the last one of that width the network registers (torchvision's ``fc`` or
    ``classifier[-1]``, Hugging Face's ``classifier``)."""

    def __init__(self, network: Any, classes: int, what: str):
        super().__init__()
        self.network = network
        self.what = what
        heads = [m for m in network.modules() if isinstance(m, torch.nn.Linear) and m.out_features == classes]
        if not heads:
            raise ModelError(f"{what} has no final Linear layer to {classes} classes, so --embedding cannot find its "
                             "pooled features; import it without --embedding and declare a tensor of its model.onnx "
                             'as "embedding" in preprocess.json')
        self._head = (heads[-1],)  # a tuple, so that torch does not register the layer twice

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen: list[torch.Tensor] = []
        # hooked only while this module runs, so the plain network (and its export) stays as it was
        hook = self._head[0].register_forward_pre_hook(lambda _module, inputs: seen.append(inputs[0]))
        try:
            logits = self.network(x)
        finally:
            hook.remove()
        if not seen or seen[-1].ndim != 2:
            found = "never runs" if not seen else f"sees shape {list(seen[-1].shape)}"
            raise ModelError(f"{self.what}'s final Linear layer {found}, not [batch, features]; import it without "
                             '--embedding and declare a tensor of its model.onnx as "embedding" in preprocess.json')
        return logits, seen[-1]
