"""A user's ONNX model on the GPU paths, on the CPU: the conversion to torch, the precision gate, the driver's
refusals, and the gpu engine (DALI's CPU backend) and the gpu profile in a real tritonserver (KIND_CPU) answering
like ONNX Runtime. The GPU tier's counterpart is tests/gpu/test_user_model_on_gpu.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import EngineError, ModelError
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE, load_model
from pipeline.triton import contract as tn
from support.oddities import photo_set
from support.paths import PHOTOS
from support.user_models import CLASSES, SPEC, TinyNet, TokenNet, model_folder

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")
pytest.importorskip("onnxslim")

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("user") / "tiny", TinyNet(scale=20.0))  # decided answers


def ort_logits(bundle, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(bundle.onnx_path), providers=["CPUExecutionProvider"])
    return session.run(None, {bundle.input_name: x})[0]


def test_the_converted_network_computes_the_onnx_graph_with_its_shapes_on_the_host(folder):
    import onnx2torch

    from pipeline.gpu.onnx_torch import HostShape, HostShapes, convert_checked

    bundle = load_model(folder)
    x = np.random.default_rng(1).standard_normal((3, 3, 64, 64)).astype(np.float32)
    ref = ort_logits(bundle, x)
    # The graph as written: the dynamic flatten's Shape/Gather/Concat/Reshape run on the host.
    for net in (convert_checked(bundle.onnx_path, bundle.spec).network,
                HostShapes(onnx2torch.convert(str(bundle.onnx_path)))):
        with torch.inference_mode():
            got = net(torch.from_numpy(x)).numpy()
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
        assert any(not b.is_floating_point() for b in net.buffers())  # the Reshape's target, Gather's index
        net.to("meta")  # any other device: the integer constants stay where the shape arithmetic runs
        assert all(b.device.type == "cpu" for b in net.buffers() if not b.is_floating_point())
        assert all(b.device.type == "meta" for b in net.buffers() if b.is_floating_point())
    shape = next(m for m in net.modules() if isinstance(m, HostShape))
    assert shape(torch.empty(3, 2, device="meta")).device.type == "cpu"


def test_the_precision_gate_keeps_fp16_and_refuses_it_where_fp16_overflows(folder, tmp_path):
    from pipeline.gpu.onnx_torch import convert_checked
    from pipeline.gpu.precision import GATE_IMAGES, GATE_REL_L2, choose_half

    bundle = load_model(folder)
    good = choose_half(convert_checked(bundle.onnx_path, bundle.spec).network, bundle.spec, torch.device("cpu"))
    assert good.half and good.rel_l2 < GATE_REL_L2 and good.top1_differ == 0 and good.images == GATE_IMAGES
    huge = load_model(model_folder(tmp_path / "huge", TinyNet(scale=1e6)))  # logits far beyond FP16's 65504
    bad = choose_half(convert_checked(huge.onnx_path, huge.spec).network, huge.spec, torch.device("cpu"))
    assert not bad.half and bad.rel_l2 == float("inf")
    assert "relative L2" in bad.describe()


def test_the_precision_gate_refuses_fp16_for_a_network_that_decides_too_little_of_its_sample(folder, tmp_path):
    """Near-uniform logits (random weights, an untrained head) leave no top-1 the near-tie rule could check: FP32."""
    from pipeline.gpu.onnx_torch import convert_checked
    from pipeline.gpu.precision import GATE_MIN_DECIDED, choose_half

    bundle = load_model(folder)
    good = choose_half(convert_checked(bundle.onnx_path, bundle.spec).network, bundle.spec, torch.device("cpu"))
    assert good.half and good.decided >= GATE_MIN_DECIDED
    flat = load_model(model_folder(tmp_path / "flat", TinyNet(scale=1e-4)))  # the same network, every margin tiny
    gate = choose_half(convert_checked(flat.onnx_path, flat.spec).network, flat.spec, torch.device("cpu"))
    assert not gate.half and gate.decided < GATE_MIN_DECIDED and gate.top1_differ == 0
    assert f"the gate needs {GATE_MIN_DECIDED}" in gate.describe()


def test_a_transformer_shaped_graph_converts_and_compiles_with_its_shapes_read_on_the_host(tmp_path):
    """Expand and Reshape of computed shapes (a ViT's class token, its attention's heads) read their shape on the
    host, so the converted graph matches ONNX Runtime and compiles (torch.Size of a traced tensor does not)."""
    from pipeline.gpu.onnx_torch import HostExpand, HostReshape, convert_checked
    from pipeline.gpu.topk_network import TopKNetwork

    bundle = load_model(model_folder(tmp_path / "token", TokenNet()))
    net = convert_checked(bundle.onnx_path, bundle.spec).network
    kinds = {type(m) for m in net.modules()}
    assert HostExpand in kinds and HostReshape in kinds, kinds
    x = np.random.default_rng(3).standard_normal((3, 3, 64, 64)).astype(np.float32)
    with torch.inference_mode():
        got = net(torch.from_numpy(x)).numpy()
    ref = ort_logits(bundle, x)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    top = TopKNetwork(net, crop=(64, 64), device=torch.device("cpu"), half=False, batch_size=3, cuda_graph=False,
                      top_k=2, compile=True)
    top.warmup()
    assert top.compiled, top.compile_problem
    assert np.abs(top.run(torch.from_numpy(x)).numpy() - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_a_converted_network_runs_compiled_where_its_logits_match_and_eager_where_not(folder, monkeypatch, caplog):
    """TopKNetwork compiles a converted model.onnx (on CUDA by default; asked for here on the CPU), checks the
    compiled logits against the eager network's at warmup, and keeps the eager network where compiling fails or
    answers otherwise, saying so once."""
    from pipeline.gpu.onnx_torch import convert_checked
    from pipeline.gpu.topk_network import TopKNetwork

    bundle = load_model(folder)
    net = convert_checked(bundle.onnx_path, bundle.spec).network
    assert net.compile_by_default
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((4, 3, 64, 64)).astype(np.float32))
    with torch.inference_mode():
        want = net(x)

    def make(**kw):
        return TopKNetwork(net, crop=(64, 64), device=torch.device("cpu"), half=False, batch_size=4,
                           cuda_graph=False, top_k=2, **kw)

    assert not make().compiled  # the default compiles on CUDA only
    compiled = make(compile=True)
    compiled.warmup()
    assert compiled.compiled
    assert torch.allclose(compiled.run(x), want, atol=1e-4)

    real_compile = torch.compile
    for fake, said in ((lambda module, **kw: (lambda x: module(x) * 2), "differ from the eager network's"),
                       (lambda module, **kw: (lambda x: 1 / 0), "compiling failed (ZeroDivisionError")):
        monkeypatch.setattr(torch, "compile", fake)
        caplog.clear()
        top = make(compile=True)
        top.warmup()
        assert not top.compiled and torch.allclose(top.run(x), want, atol=1e-6)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and said in warnings[0] and "runs uncompiled" in warnings[0], warnings
    monkeypatch.setattr(torch, "compile", real_compile)


def unsupported_folder(path):
    """A model whose graph has Hardmax, which onnx2torch cannot convert."""
    import onnx
    from onnx import TensorProto, helper

    path.mkdir(parents=True)
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"]), helper.make_node("Hardmax", ["flat"], ["logits"])],
        "odd",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 64, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 3])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path / MODEL_FILE)
    (path / LABELS_FILE).write_text("r\ng\nb\n")
    (path / SPEC_FILE).write_text(json.dumps(SPEC))
    return path


@pytest.mark.parametrize("engine", ["gpu", "triton"])
def test_an_operator_the_converter_lacks_is_refused_in_the_driver(tmp_path, monkeypatch, engine):
    from pipeline.engines.registry import engine_spec

    folder = unsupported_folder(tmp_path / "odd")
    with pytest.raises(ModelError, match=r"its graph uses Hardmax \(opset 17\), which the ONNX-to-torch converter "
                                         r"\(onnx2torch\) lacks; use --engine onnx"):
        engine_spec(engine).check_model(load_model(folder), {"profile": "gpu"} if engine == "triton" else {},
                                        gpus=(1, "this machine"))  # as on a GPU node
    # Through the CLI: one line, and nothing written.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dest = tmp_path / "dest"
    result = CliRunner().invoke(main, ["run", str(PHOTOS), "--output", str(dest), "--model", str(folder),
                                       "--engine", "gpu", "--engine-option", "device=cpu"])
    assert result.exit_code != 0 and not dest.exists()
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Hardmax" in errors[0] and "--engine onnx" in errors[0], result.stderr


def test_the_gpu_engine_refuses_an_actor_without_a_gpu_unless_told_cpu(folder, monkeypatch):
    from pipeline.engines.gpu import GpuEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineError, match=r"^--engine gpu runs on a GPU and this actor has none that it can use; "
                                          r"use --engine onnx, or --engine-option device=cpu"):
        GpuEngine(load_model(folder))


def test_a_users_model_answers_like_onnx_runtime_in_process_and_in_tritonserver(folder, tmp_path):
    """The gpu engine (DALI's CPU backend, torch on the CPU) and the gpu profile's python model in a real
    tritonserver run the converted network: their top-1 is ONNX Runtime's wherever its margin is no near-tie."""
    pytest.importorskip("nvidia.dali")
    from pipeline.engines.gpu import GpuEngine
    from pipeline.engines.onnx import OnnxEngine

    bundle = load_model(folder)
    images = photo_set()[:8]
    with OnnxEngine(bundle, top_k=CLASSES) as reference:
        expected = reference.classify(images)
    with GpuEngine(bundle, top_k=CLASSES, device="cpu", batch_size=4) as local:
        in_process = local.classify(images)
    served = served_on_cpu(folder, bundle, images, tmp_path)
    decided = [i for i, r in enumerate(expected) if r.scores[0] - r.scores[1] > 0.02]
    assert len(decided) >= 4
    for rows in (in_process, served):
        assert all(r.status == "ok" for r in rows)
        assert [rows[i].class_ids[0] for i in decided] == [expected[i].class_ids[0] for i in decided]
        # DALI's resize is not Pillow's to the last bit: probabilities close, not equal.
        assert max(abs(a.scores[0] - b.scores[0]) for a, b in zip(rows, expected)) < 0.05


def test_the_served_gpu_profile_runs_a_fixed_batch_model_in_batches_of_exactly_that_size(tmp_path):
    """A model exported with batch 3 as a number, asked for 8 images in requests of 4: every answer is ONNX
    Runtime's (which runs it in batches of 3 too), none fails and none is split off."""
    pytest.importorskip("nvidia.dali")
    from pipeline.engines.onnx import OnnxEngine

    folder = model_folder(tmp_path / "fixed", TinyNet(scale=20.0), fixed_batch=3)
    bundle = load_model(folder)
    assert bundle.fixed_batch == 3
    images = photo_set()[:8]
    with OnnxEngine(bundle, top_k=CLASSES) as reference:
        expected = reference.classify(images)
    served = served_on_cpu(folder, bundle, images, tmp_path)
    assert all(r.status == "ok" for r in served)
    decided = [i for i, r in enumerate(expected) if r.scores[0] - r.scores[1] > 0.02]
    assert len(decided) >= 4
    assert [served[i].class_ids[0] for i in decided] == [expected[i].class_ids[0] for i in decided]


def served_on_cpu(folder, bundle, images, tmp_path):
    """The answers of the gpu profile's python model for ``folder``, in a real tritonserver on the CPU, asked in
    requests of 4."""
    from pipeline.engines.triton import TritonEngine
    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.server import TritonServer

    repo = build_gpu_repository(str(folder), tmp_path / "repo", instances=1, batch_size=4, max_batch_size=16)
    assert (repo / tn.MODEL_NAME / "1" / MODEL_FILE).read_bytes() == bundle.onnx_path.read_bytes()
    config = repo / tn.MODEL_NAME / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
    with TritonServer(repo) as server:
        engine = TritonEngine(bundle, url=server.grpc_url, top_k=CLASSES, request_batch=4, concurrency=2)
        served = engine.classify(images)
        engine.close()
    return served
