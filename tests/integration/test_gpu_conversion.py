"""A user's model.onnx converted for the GPU paths keeps the model's answers: every folder ``bulk-classify model
import`` writes converts and agrees with ONNX Runtime, a conversion that does not is refused (in the driver, and on
each instance), and the checked conversion is cached per model and card, rebuilt when anything it depends on changes.
The GPU tier's counterpart is tests/gpu/test_user_model_on_gpu.py."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import EngineError, ModelError
from pipeline.model.folder import load_model
from support.paths import PHOTOS, REPO
from support.user_models import TinyNet, model_folder

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")
onnxslim = pytest.importorskip("onnxslim")

from pipeline.gpu import network_cache, onnx_torch  # noqa: E402 - needs the gpu extra, skipped above without it
from pipeline.model import onnx_graph  # noqa: E402
from pipeline.model_import.core import ImportOptions, import_model  # noqa: E402

# Each source and architecture family a user brings (random weights, seed 0): timm's TF-padded EfficientNet-Lite
# (computed padding, Clip with an omitted bound), EfficientNet, MobileNetV3 (hard-swish), ResNet, ConvNeXt and ViT;
# torchvision's ResNet and MobileNetV3; a Hugging Face ViT from a config.
IMPORTS = {
    "timm-tf_efficientnet_lite0": ("timm", "tf_efficientnet_lite0"),
    "timm-efficientnet_b0": ("timm", "efficientnet_b0"),
    "timm-mobilenetv3_small_100": ("timm", "mobilenetv3_small_100"),
    "timm-resnet18": ("timm", "resnet18"),
    "timm-convnext_atto": ("timm", "convnext_atto"),
    "timm-vit_tiny_patch16_224": ("timm", "vit_tiny_patch16_224"),
    "torchvision-resnet18": ("torchvision", "resnet18"),
    "torchvision-mobilenet_v3_small": ("torchvision", "mobilenet_v3_small"),
    "huggingface-vit": ("huggingface", None),
}


def imported(name: str, work) -> load_model:
    """The folder ``bulk-classify model import`` writes for ``IMPORTS[name]``, loaded."""
    source, arch = IMPORTS[name]
    torch.manual_seed(0)
    checkpoint = work / f"{name}.pth"
    if source == "timm":
        import timm

        torch.save(timm.create_model(arch, pretrained=False).state_dict(), checkpoint)
    elif source == "torchvision":
        import torchvision

        torch.save(torchvision.models.get_model(arch, weights=None).state_dict(), checkpoint)
    else:
        from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

        arch = str(work / "hf")
        config = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                           initializer_range=0.2, num_labels=10)
        ViTForImageClassification(config).save_pretrained(arch)
        ViTImageProcessor().save_pretrained(arch)
        checkpoint = None
    # A loose parity bar: random weights answer nearly alike for every photo; this test is about the conversion.
    result = import_model(source, arch, work / "model", checkpoint=str(checkpoint) if checkpoint else None,
                          options=ImportOptions(sample=2, min_agreement=0.0, max_logit_diff=1.0))
    return load_model(result.folder)


@pytest.mark.parametrize("name", list(IMPORTS))
def test_every_imported_folder_converts_and_agrees_with_onnx_runtime(name, tmp_path):
    """Both conversions: the one the GPU paths keep, and the graph's exact normal form without onnxslim, which is
    what runs where slimming would change the outputs."""
    bundle = imported(name, tmp_path)
    conversion = onnx_torch.convert_checked(bundle.onnx_path, bundle.spec)
    assert conversion.agreement.within(onnx_torch.CONVERSION_REL_L2), conversion.agreement.describe()
    assert conversion.agreement.images == len(list(onnx_torch.SAMPLE_DIR.glob("*.jpg"))) + onnx_torch.REFERENCE_TENSORS
    import onnx

    normal, _ = onnx_graph.normalize(onnx.load(str(bundle.onnx_path)))
    inputs = conversion.reference.inputs
    network = onnx_torch.HostShapes(onnx_torch._to_torch(normal, bundle.onnx_path), inputs[:1]).eval()
    found = onnx_torch.agreement(onnx_torch.run_network(network, inputs), conversion.reference.outputs,
                                 probabilities=False)
    assert found.within(onnx_torch.CONVERSION_REL_L2), found.describe()
    # On another device (meta stands in for a GPU here) the shape arithmetic stays on the CPU and the data goes
    # there: no operator sees tensors of two devices (timm's tf_ padding computes in float from the input's size).
    for net in (conversion.network, network):
        net.to("meta")
        with torch.inference_mode():
            out = net(torch.empty(2, *bundle.spec.input_shape, device="meta"))
        assert out.device.type == "meta" and out.shape == (2, conversion.reference.outputs.shape[1])


def test_the_normal_form_keeps_the_graph_exactly_and_converts_what_onnx2torch_lacks(tmp_path):
    """An omitted optional input, an Identity alias of a weight and a Clip with computed bounds: onnx2torch refuses
    the graph as written (as it refused timm's tf_efficientnet_lite1 export); the normal form converts, and ONNX
    Runtime gives the same numbers on both."""
    import onnx
    import onnx2torch
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [
        helper.make_node("Identity", ["b"], ["b_alias"]),
        helper.make_node("Conv", ["input", "w", "b_alias"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.float32))),
        helper.make_node("Clip", ["conv", "zero", ""], ["relu"]),  # max omitted, written as an empty name
        helper.make_node("ReduceMean", ["relu"], ["hi"], keepdims=0),  # a bound computed from the data
        helper.make_node("Clip", ["relu", "", "hi"], ["clipped"]),
        helper.make_node("GlobalAveragePool", ["clipped"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "exporter", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                                  ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 4])],
                              initializer=[weight, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    with pytest.raises(Exception):
        onnx2torch.convert(model)
    normal, notes = onnx_graph.normalize(model)
    assert notes == ["1 omitted optional inputs dropped", "1 Identity aliases of initializers resolved",
                     "1 Clip with computed bounds as Max/Min"]
    onnx.checker.check_model(normal)
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    want = onnx_graph.run_onnxruntime(model, x)
    assert np.array_equal(onnx_graph.run_onnxruntime(normal, x), want)
    with torch.inference_mode():
        got = onnx2torch.convert(normal)(torch.from_numpy(x)).numpy()
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


REAL_SLIM = onnxslim.slim


def changing_slim(model):
    """What onnxslim 0.1.98 did to EfficientNet-Lite1's real weights: a graph with other outputs."""
    from onnx import numpy_helper

    out = REAL_SLIM(model)
    last = out.graph.initializer[-1]
    values = numpy_helper.to_array(last)
    last.CopyFrom(numpy_helper.from_array(np.asarray(values * 2 + 1, dtype=values.dtype), last.name))
    return out


@pytest.fixture()
def folder(tmp_path):
    return model_folder(tmp_path / "tiny", TinyNet(scale=20.0))


def test_a_slimmed_graph_that_changes_the_outputs_is_never_converted(folder, monkeypatch):
    """onnxslim's graph is kept only where ONNX Runtime says it computes the same; and were it forced through, the
    check against ONNX Runtime would refuse its conversion and keep the exact one."""
    bundle = load_model(folder)
    monkeypatch.setattr(onnxslim, "slim", changing_slim)
    conversion = onnx_torch.convert_checked(bundle.onnx_path, bundle.spec)
    assert conversion.note.startswith("the graph as written; onnxslim's graph changed the outputs by")
    assert conversion.agreement.within(onnx_torch.CONVERSION_REL_L2)
    # Slimming forced (the rule bypassed): the wrong graph converts, disagrees, and the exact one is used instead.
    monkeypatch.setattr(onnx_torch, "faithful_slim", lambda model, probe, **kw: (changing_slim(model), "forced"))
    conversion = onnx_torch.convert_checked(bundle.onnx_path, bundle.spec)
    assert conversion.note == "the graph as written" and conversion.agreement.within(onnx_torch.CONVERSION_REL_L2)


def wrong_converter(monkeypatch):
    """Every conversion computes another function (as a converter bug would): its outputs doubled."""
    real = onnx_torch._to_torch

    class Doubled(torch.nn.Module):
        def __init__(self, graph):
            super().__init__()
            self.graph = graph

        def forward(self, x):
            return self.graph(x) * 2

    monkeypatch.setattr(onnx_torch, "_to_torch", lambda graph, path: Doubled(real(graph, path)))


@pytest.mark.parametrize("engine", ["gpu", "triton"])
def test_a_conversion_that_does_not_agree_is_refused_in_one_line_before_anything_is_written(
        folder, tmp_path, monkeypatch, engine):
    from pipeline.engines.registry import engine_spec

    monkeypatch.setenv("BULK_CLASSIFY_CACHE_DIR", str(tmp_path / "cache"))
    wrong_converter(monkeypatch)
    refusal = (r"cannot run on the GPU: its network converted to torch \(.*\) gives outputs .* from ONNX Runtime's "
               r"\(relative L2\) and \d+ of 16 reference images with another top-1 class \(allowed 0.001\); use "
               r"--engine onnx")
    with pytest.raises(ModelError, match=refusal):  # the driver's model check, as on a GPU node
        engine_spec(engine).check_model(load_model(folder), {"profile": "gpu"} if engine == "triton" else {},
                                        gpus=(1, "this machine"))
    assert not list((tmp_path / "cache" / network_cache.CACHE_FOLDER).glob("*/entry.json"))  # nothing cached
    if engine == "triton":
        return
    # Through the CLI (the gpu engine on the CPU here): one line, and nothing written.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dest = tmp_path / "dest"
    result = CliRunner().invoke(main, ["run", str(PHOTOS), "--output", str(dest), "--model", str(folder),
                                       "--engine", "gpu", "--engine-option", "device=cpu"])
    assert result.exit_code != 0 and not dest.exists(), result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and re.search(refusal, errors[0]), result.stderr


def test_the_checked_network_is_cached_and_each_change_makes_a_new_entry(folder, tmp_path, monkeypatch, caplog):
    bundle = load_model(folder)
    root = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="pipeline.gpu.network_cache")
    first = network_cache.checked_network(bundle.onnx_path, bundle.spec, root=root)
    assert not first.from_cache and "converted" in caplog.text and (first.entry / network_cache.ENTRY_FILE).is_file()
    caplog.clear()
    again = network_cache.checked_network(bundle.onnx_path, bundle.spec, root=root)
    assert again.from_cache and again.entry == first.entry and "converted" not in caplog.text
    x = again.conversion.reference.inputs
    assert np.array_equal(onnx_torch.run_network(again.conversion.network, x),
                          onnx_torch.run_network(first.conversion.network, x))
    assert np.array_equal(again.conversion.reference.outputs, first.conversion.reference.outputs)

    def key(**change):
        return network_cache.entry_key(change.get("path", bundle.onnx_path), change.get("spec", bundle.spec),
                                       change.get("fixed_batch"))[0]

    base = key()
    retrained = model_folder(tmp_path / "retrained", TinyNet(scale=21.0))
    assert key(path=retrained / "model.onnx") != base  # other weights
    import dataclasses

    assert key(spec=dataclasses.replace(bundle.spec, mean=(0.0, 0.0, 0.0))) != base  # other preprocessing
    assert key(fixed_batch=4) != base
    for library in network_cache.KEY_LIBRARIES:  # another torch, converter or runtime
        real = network_cache.library_version
        monkeypatch.setattr(network_cache, "library_version", lambda name, lib=library: "0" if name == lib else real(name))
        assert key() != base, library
        monkeypatch.setattr(network_cache, "library_version", real)
    monkeypatch.setattr(network_cache, "CODE_FILES", network_cache.CODE_FILES[:-1])  # other conversion code
    assert key() != base


def test_each_kind_of_card_has_its_own_folder_for_the_gate_and_compiled_kernels(folder, tmp_path):
    bundle = load_model(folder)
    entry = network_cache.checked_network(bundle.onnx_path, bundle.spec, root=tmp_path).entry
    h100 = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "torch": "2.11.0+cu130", "cuda": "13.0",
            "triton": "3.5.1"}
    folders = {network_cache.card_folder_for(entry, dict(h100, **change))
               for change in ({}, {"gpu": "NVIDIA H200"}, {"capability": "10.0"}, {"torch": "2.12.0+cu130"},
                              {"cuda": "13.1"}, {"triton": "3.6.0"})}
    assert len(folders) == 6 and all(f.parent.parent == entry and f.is_dir() for f in folders)
    card = network_cache.card_folder_for(entry, h100)
    assert json.loads((card / "card.json").read_text()) == h100
    assert network_cache.read_gate(card) is None
    network_cache.write_gate(card, {"half": False, "rel_l2": 0.004, "top1_differ": 1, "images": 16, "decided": 12})
    assert network_cache.read_gate(card)["half"] is False
    (card / network_cache.GATE_FILE).write_text("{")  # torn: computed again, never trusted
    assert network_cache.read_gate(card) is None
    network_cache.use_compile_cache(card)
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(card / network_cache.INDUCTOR_FOLDER)


@pytest.mark.parametrize("damage", ["truncated network", "truncated reference", "torn record", "other key"])
def test_a_damaged_or_mismatched_entry_is_rebuilt_not_trusted(folder, tmp_path, damage, caplog):
    bundle = load_model(folder)
    first = network_cache.checked_network(bundle.onnx_path, bundle.spec, root=tmp_path)
    entry = first.entry
    if damage == "truncated network":
        path = entry / network_cache.NETWORK_FILE
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "truncated reference":
        path = entry / network_cache.REFERENCE_FILE
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "torn record":
        path = entry / network_cache.ENTRY_FILE
        path.write_text(path.read_text()[:40])
    else:
        record = json.loads((entry / network_cache.ENTRY_FILE).read_text())
        record["key"]["torch"] = "1.0"
        (entry / network_cache.ENTRY_FILE).write_text(json.dumps(record))
    caplog.set_level(logging.WARNING, logger="pipeline.gpu.network_cache")
    rebuilt = network_cache.checked_network(bundle.onnx_path, bundle.spec, root=tmp_path)
    assert not rebuilt.from_cache and rebuilt.entry == entry
    assert "is not usable" in caplog.text and "converting again" in caplog.text
    assert network_cache.checked_network(bundle.onnx_path, bundle.spec, root=tmp_path).from_cache
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary or trash folder left


def test_processes_starting_together_convert_once(folder, tmp_path):
    """The instances of a node: one converts and writes, the others wait for its lock and load."""
    script = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              "from pipeline.model.folder import load_model\nfrom pipeline.gpu.network_cache import checked_network\n"
              f"b = load_model({str(folder)!r})\n"
              f"print('FROM_CACHE', checked_network(b.onnx_path, b.spec, root={str(tmp_path / 'c')!r}).from_cache)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    said = [line for out in outs for line in out.splitlines() if line.startswith("FROM_CACHE")]
    assert sorted(said) == ["FROM_CACHE False"] + ["FROM_CACHE True"] * 2, outs


def test_an_instance_whose_network_disagrees_with_onnx_runtime_refuses_to_start(folder, tmp_path, monkeypatch, caplog):
    """Each GPU instance holds the network as it runs there to ONNX Runtime's outputs before it classifies; here the
    gpu engine on the CPU (DALI's CPU backend), with its start said in one line."""
    pytest.importorskip("nvidia.dali")
    from pipeline.engines.gpu import GpuEngine

    monkeypatch.setenv("BULK_CLASSIFY_CACHE_DIR", str(tmp_path / "cache"))
    bundle = load_model(folder)
    caplog.set_level(logging.INFO)
    with GpuEngine(bundle, device="cpu", batch_size=4) as engine:
        assert engine.classify([(PHOTOS / "chelsea.jpg").read_bytes()])[0].status == "ok"
    start = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpu classifier start on cpu")]
    assert len(start) == 1 and "ONNX Runtime check" in start[0] and "DALI" in start[0], start
    assert "network converted and checked in" in start[0]
    caplog.clear()
    with GpuEngine(bundle, device="cpu", batch_size=4):  # the next instance: the node's cache
        pass
    start = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpu classifier start on cpu")]
    assert len(start) == 1 and "network loaded from the cache in" in start[0], start
    from pipeline.gpu.networks import load_network

    network = load_network(bundle)
    with torch.no_grad():
        next(p for p in network.parameters() if p.dim() == 4).mul_(-1)  # the network changed after its check
    with pytest.raises(EngineError, match=r"^the converted network on cpu \(fp32\) gives outputs .* from ONNX "
                                          r"Runtime's .*; run this model with --engine onnx$"):
        GpuEngine(bundle, device="cpu", batch_size=4, network=network)


def test_the_driver_converts_and_checks_once_then_finds_the_cache(folder, tmp_path, monkeypatch, caplog):
    from pipeline.engines.registry import engine_spec

    monkeypatch.setenv("BULK_CLASSIFY_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="pipeline.gpu.networks")
    spec = engine_spec("gpu")
    spec.check_model(load_model(folder), {}, gpus=(1, "this machine"))
    assert "its network for the GPU converted in" in caplog.text
    caplog.clear()
    spec.check_model(load_model(folder), {}, gpus=(1, "this machine"))
    assert "its network for the GPU found in the cache" in caplog.text
    with pytest.raises(ModelError):
        wrong_converter(monkeypatch)
        spec.check_model(load_model(model_folder(tmp_path / "other", TinyNet(scale=3.0))), {},
                         gpus=(1, "this machine"))


def test_rows_onnx_runtime_cannot_compute_must_be_such_rows_after_the_conversion_too():
    """A network that is NaN on some input is NaN there after conversion as well (an engine_error row on every
    engine), and agrees; a conversion that computes a number where ONNX Runtime could not does not."""
    want = np.array([[1.0, 2.0, 0.5], [np.nan, 1.0, 0.0], [3.0, 0.1, 0.2]], np.float32)
    same = want + 1e-6
    assert onnx_torch.agreement(same, want, probabilities=False).within(onnx_torch.CONVERSION_REL_L2)
    invented = np.nan_to_num(want)
    found = onnx_torch.agreement(invented, want, probabilities=False)
    assert not found.within(onnx_torch.CONVERSION_REL_L2) and found.top1_differ == 1
    flipped = np.roll(want, 1, axis=1)
    assert onnx_torch.agreement(flipped, want, probabilities=False).top1_differ == 2


def test_a_conversion_whose_shape_arithmetic_would_meet_gpu_data_is_refused_in_the_driver(folder, monkeypatch):
    """Where a converted graph would mix the host's shape tensors with the device's data (as timm's tf_ padding did
    before its float constants stayed on the host), the driver's check runs it on the meta device and refuses it in
    one line, instead of a GPU instance failing to start."""
    bundle = load_model(folder)
    real = onnx_torch._to_torch

    class HostTensorMeetsData(torch.nn.Module):  # a host tensor added to the data, as that padding's constants were
        def __init__(self, graph):
            super().__init__()
            self.graph = graph

        def forward(self, x):
            out = self.graph(x)
            return out + torch.zeros(out.shape[1:])

    monkeypatch.setattr(onnx_torch, "_to_torch", lambda graph, path: HostTensorMeetsData(real(graph, path)))
    with pytest.raises(ModelError, match=r"cannot run on the GPU: its network converted to torch \(.*\) fails off the "
                                         r"CPU \(RuntimeError: .*\); use --engine onnx"):
        onnx_torch.convert_checked(bundle.onnx_path, bundle.spec)
