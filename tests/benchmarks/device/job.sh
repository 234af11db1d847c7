#!/usr/bin/env bash
# The whole job on the GPU machine as a user runs it (tests/benchmarks/bench_job.py), after the kit's setup
# (README.md here). Arguments go to bench_job.py, e.g.:
#   bash tests/benchmarks/device/job.sh --variant default= --variant inproc='--engine gpu'
# Writes $OUT/j/: bench.log (the table), bench_job.json, one log per variant, nvidia_smi.csv, quiet.txt.
set -u
source "$HOME/env/activate.sh"
mkdir -p "$OUT/j"
python3 tests/benchmarks/device/probe_quiet.py > "$OUT/j/quiet.txt" 2>&1
cat "$OUT/j/quiet.txt"
timeout 560 python3 tests/benchmarks/bench_job.py --work "$HOME/job" --out "$OUT/j" "$@" > "$OUT/j/bench.log" 2>&1
echo "bench_job rc=$?"
grep -v "^[0-9: ,-]*bench_job result" "$OUT/j/bench.log" | tail -40
