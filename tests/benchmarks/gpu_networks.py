"""Networks the GPU benchmarks run instead of the model's own: a random-weight ResNet-50 and the default model in each
of its other padding layouts (``LITE0_LAYOUTS`` of lite0_layouts.py).

In process, ``register()`` adds them to the library's network registry (``pipeline.gpu.networks
.register_network``), so ``--engine-option network=resnet50`` or a layout name selects one. A served model runs in
Triton's stub process, where nothing was registered: ``served(NAME)`` gives the ``gpu_networks:NAME`` reference its
config names, and puts this folder on the PYTHONPATH the server passes to its stubs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from lite0_layouts import LITE0_LAYOUTS, layout_network  # noqa: E402
from pipeline.gpu.networks import register_network  # noqa: E402
from pipeline.errors import EngineError  # noqa: E402
from pipeline.model.folder import is_builtin  # noqa: E402

RESNET50 = "resnet50"


def resnet50_random(num_classes: int = 1000, seed: int = 0):
    """torchvision's ResNet-50 with random weights (seeded), for speed only."""
    import torch
    from torchvision.models import resnet50

    torch.manual_seed(seed)
    return resnet50(weights=None, num_classes=num_classes).eval()


def resnet50(bundle):
    """The network factory: a random-weight ResNet-50 with the bundle's classes."""
    return resnet50_random(len(bundle.labels) or 1000)


def lite0_in_layout(layout: str):
    """The factory of the default model in ``layout`` (refused for a user's model)."""

    def factory(bundle):
        from pipeline.model.default_model import load_checkpoint

        if not is_builtin(bundle):
            raise EngineError(f"network {layout!r} is the default model in another layout; {bundle.name!r} is not it")
        return layout_network(load_checkpoint(), layout)

    return factory


# The served form of each layout: gpu_networks:lite0_<layout>.
for _layout in LITE0_LAYOUTS:
    globals()[f"lite0_{_layout}"] = lite0_in_layout(_layout)


def register() -> None:
    """Register ``resnet50`` and every ``LITE0_LAYOUTS`` name in this process."""
    register_network(RESNET50, resnet50)
    for name in LITE0_LAYOUTS:
        register_network(name, lite0_in_layout(name))


def served(name: str) -> str:
    """The ``network`` value that selects ``name`` in a served model: ``gpu_networks:<factory>``."""
    folders = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(HERE) not in folders:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, folders)])
    if name == RESNET50:
        return f"{__name__}:resnet50"
    if name in LITE0_LAYOUTS:
        return f"{__name__}:lite0_{name}"
    raise ValueError(f"no served network {name!r}; served networks: {RESNET50}, {', '.join(LITE0_LAYOUTS)}")
