"""tests/benchmarks/bench_gpu.py's Triton part (gpu_triton.py) on the CPU: the script's server/run/report path, checked
here so that a device call is not spent finding its bugs.

A real tritonserver serves the gpu profile's hop (tests/benchmarks/hop_model.py: execute(), the request stream and
its backlog, responses) on KIND_CPU instances; actor-shaped clients time it, the bad-inputs request runs between two
timed runs, and each instance's share comes from the stopped server's log.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest

from support.paths import BENCHMARKS



@pytest.fixture
def bench_gpu(monkeypatch):
    """bench_gpu.py and its Triton part, imported from tests/benchmarks/, with the gpu profile built for the CPU."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_gpu
    import gpu_triton
    import image_sets

    from pipeline.triton import repository

    build = repository.build_gpu_repository

    def on_cpu(model, output, **options):
        out = build(model, output, **options)
        config = Path(output) / "classifier" / "config.pbtxt"
        config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
        return out

    monkeypatch.setattr(repository, "build_gpu_repository", on_cpu)
    yield types.SimpleNamespace(make_set=image_sets.make_set, triton_part=gpu_triton.triton_part,
                                print_table=bench_gpu.print_table)
    for name in ("bench_gpu", "gpu_triton", "gpu_timing", "gpu_dali", "gpu_parity", "image_sets"):
        sys.modules.pop(name, None)


def test_triton_part_times_the_hop_and_reports_each_instance(bench_gpu, tmp_path, capsys):
    args = argparse.Namespace(
        servers=["2:bl1"], triton_nets="hop", triton_batch=32, triton_max_batch=1024,
        queue_delay_us=100, prep_workers=2, hw_decoder_load=None, half="auto", dali_depth=None, dali_threads=None,
        client=[(16, 4)], client_procs=[1], triton_images=256, seconds=0.5, py_spy=False, out=tmp_path,
        bad_inputs="between", network_instances=1)
    sets = {"imagenet": bench_gpu.make_set(32, "imagenet", 0)}
    results: dict = {}
    bench_gpu.triton_part(args, results, sets)
    for key in ("triton_hop_imagenet_r16_c4_i2_bl1", "triton_hop_imagenet_r16_c4_i2_bl1_afterbad"):
        row = results[key]
        assert row["img_s"] > 0 and row["inference_count"] >= 256 and row["instances"] == 2, row
    assert [r[0] for r in results["triton_bad_inputs_i2_bl1"]] == ["ok", "error", "error", "ok"]
    shares = results["streams_i2_bl1"]
    assert len(shares) == 2 and all("max_backlog 32 images" in line for line in shares), shares
    bench_gpu.print_table(dict(results, sets={"imagenet": {}}))
    assert "triton r16_c4_i2_bl1_afterbad" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="write N"):
        bench_gpu.triton_part(argparse.Namespace(servers=["2:blx"]), {}, sets)
