"""Fleet sizing from a measured curve: perf_analyzer's CSV, the generic CSV/JSON, and the errors users see."""

from __future__ import annotations

import json
import math
import sys

import pytest

from pipeline.errors import ConfigError
from pipeline.sizing import format_sizing, load_curve, size_fleet
from support.paths import BENCHMARKS, DATA

# perf_analyzer -f layout: latencies in microseconds; a blank line then more sections may follow.
PERF_CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,\
Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency,\
Avg latency,request/response,response wait
1,410.2,50,300,20,100,2000,30,10,2400,2600,2700,3100,2450,0,0
2,780.5,50,300,40,100,2100,30,10,2500,2700,2900,3400,2560,0,0
4,1390.0,50,300,200,100,2200,30,10,2800,3100,3300,4000,2870,0,0
8,1602.1,50,300,2100,100,2300,30,10,4900,5300,5600,6400,4990,0,0
16,1610.4,50,300,7000,100,2300,30,10,9900,10500,10900,12000,9950,0,0

"""


@pytest.fixture
def perf_csv(tmp_path):
    path = tmp_path / "curve.csv"
    path.write_text(PERF_CSV)
    return str(path)


def test_perf_analyzer_csv_gives_gpus_at_65_percent_of_plateau_plus_one_spare(perf_csv):
    result = size_fleet(perf_csv, target_rate=5000)
    assert result["plateau_img_per_s"] == 1610.4
    assert result["plateau_load"] == 16
    assert result["per_gpu_img_per_s"] == pytest.approx(0.65 * 1610.4, abs=0.01)
    # 5000 / 1046.76 = 4.78 -> 5 GPUs, + 1 spare
    assert result["gpus_for_target"] == 5
    assert result["gpus"] == 6
    # the lightest load reaching 1046.76 img/s is concurrency 4, p99 4000 us
    assert result["operating_point"] == {"load": 4, "img_per_s": 1390.0, "p99_ms": 4.0}
    assert result["plateau_p99_ms"] == 12.0


def test_exact_multiple_does_not_round_up_and_parameters_apply(perf_csv):
    per_gpu = 0.65 * 1610.4
    assert size_fleet(perf_csv, target_rate=2 * per_gpu)["gpus"] == 3
    assert size_fleet(perf_csv, target_rate=2 * per_gpu + 1)["gpus"] == 4
    r = size_fleet(perf_csv, target_rate=10_000, utilization=0.5, spare=2)
    assert r["gpus_for_target"] == math.ceil(10_000 / (0.5 * 1610.4))
    assert r["gpus"] == r["gpus_for_target"] + 2
    assert size_fleet(perf_csv, target_rate=1)["gpus"] == 2  # never fewer than one working GPU


def test_generic_json_curve_from_the_gpu_benchmark(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"points": [
        {"batch_size": 64, "img_per_s": 3000.0, "p99_ms": 40.0},
        {"batch_size": 8, "img_per_s": 900.0, "p99_ms": 12.0},
        {"batch_size": 32, "img_per_s": 2600.0, "p99_ms": 20.0},
    ]}))
    curve = load_curve(str(path))
    assert [p["load"] for p in curve["points"]] == [8, 32, 64]  # sorted by load
    r = size_fleet(str(path), target_rate=20_000)
    assert r["plateau_img_per_s"] == 3000.0
    assert r["gpus_for_target"] == 11  # 20000 / 1950 = 10.26
    assert r["operating_point"]["load"] == 32 and r["operating_point"]["p99_ms"] == 20.0


def test_generic_csv_with_p99_in_seconds_and_no_load_column(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text("throughput\tp99_s\n100\t0.010\n200\t0.020\n")
    r = size_fleet(str(path), target_rate=260)
    assert r["points"][1]["p99_ms"] == pytest.approx(20.0)
    assert r["gpus"] == 3  # 260 / 130 = 2 -> 2 + 1


def test_format_names_plateau_operating_point_and_total(perf_csv):
    text = format_sizing(size_fleet(perf_csv, target_rate=5000))
    assert "plateau" in text and "first >= 65%" in text
    assert "5 GPU(s) + 1 spare = 6 GPU(s)" in text
    assert "1,046.8 img/s per GPU" in text


def test_errors_say_what_to_fix(tmp_path, perf_csv):
    with pytest.raises(ConfigError, match="cannot read curve .*perf_analyzer -f"):
        size_fleet(str(tmp_path / "missing.csv"), target_rate=10)
    bad = tmp_path / "bad.csv"
    bad.write_text("concurrency,latency\n1,2\n")
    with pytest.raises(ConfigError, match="no throughput column"):
        size_fleet(str(bad), target_rate=10)
    with pytest.raises(ConfigError, match="--target-rate"):
        size_fleet(perf_csv, target_rate=0)
    with pytest.raises(ConfigError, match="--utilization"):
        size_fleet(perf_csv, target_rate=10, utilization=1.5)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no data rows"):
        size_fleet(str(empty), target_rate=10)
    junk = tmp_path / "junk.csv"
    junk.write_text("img_per_s\nfast\n")
    with pytest.raises(ConfigError, match="is not a number"):
        size_fleet(str(junk), target_rate=10)


def test_real_perf_analyzer_csv_rows_out_of_order():
    """tests/data/perf_analyzer_portable_cpu_b8.csv: perf_analyzer 2.51 -f output (portable profile on 2 CPUs,
    batch 8, concurrency 1..4), made with tests/benchmarks/bench_perf_analyzer.py; it lists rows unsorted."""

    curve = DATA / "perf_analyzer_portable_cpu_b8.csv"
    r = size_fleet(str(curve), target_rate=100)
    assert [p["load"] for p in r["points"]] == [1, 2, 3, 4]
    assert r["plateau_img_per_s"] == 37.02 and r["plateau_load"] == 3
    assert r["operating_point"] == {"load": 3, "img_per_s": 37.02, "p99_ms": 815.515}
    assert r["gpus_for_target"] == math.ceil(100 / (0.65 * 37.0208)) == 5
    assert r["gpus"] == 6


def test_gpu_benchmark_json_one_curve_per_network(tmp_path):
    """tests/benchmarks/sizing_curves.py writes bench_gpu.py's Triton runs as one curve file per network and set."""
    sys.path.insert(0, str(BENCHMARKS))
    from sizing_curves import write_curves

    results = {
        "device": "H200",
        "triton_default_imagenet_r32_c1": {"img_s": 4000, "avg_batch_images": 30.1},
        "triton_default_imagenet_r32_c4": {"img_s": 9000, "avg_batch_images": 60.2},
        "triton_default_imagenet_r64_c4": {"img_s": 9500, "avg_batch_images": 63.0},
        "triton_resnet50_imagenet_r64_c4": {"img_s": 7000, "avg_batch_images": 63.0},
    }
    paths = write_curves(results, tmp_path)
    assert [p.name for p in paths] == ["curve_triton_default_imagenet.json", "curve_triton_resnet50_imagenet.json"]
    r = size_fleet(str(paths[0]), target_rate=10_000)
    assert [p["load"] for p in r["points"]] == [32, 128, 256]  # images in flight
    assert r["plateau_img_per_s"] == 9500 and r["operating_point"]["load"] == 128
    assert r["gpus"] == math.ceil(10_000 / (0.65 * 9500)) + 1 == 3
    assert size_fleet(str(paths[1]), target_rate=7000)["plateau_img_per_s"] == 7000


def test_cli_size_prints_the_fleet():

    from click.testing import CliRunner

    from pipeline.cli import main

    curve = DATA / "perf_analyzer_portable_cpu_b8.csv"
    result = CliRunner().invoke(main, ["size", str(curve), "--target-rate", "100"])
    assert result.exit_code == 0, result.output
    assert "5 GPU(s) + 1 spare = 6 GPU(s)" in result.output
    result = CliRunner().invoke(main, ["size", str(curve), "--target-rate", "-1"])
    assert result.exit_code != 0 and "--target-rate" in result.output
