#!/usr/bin/env bash
# Every GPU figure of docs/performance.md in one call, after the kit's setup (README.md here):
#   bash tests/benchmarks/device/figures.sh [PART ...]     PARTs: network start job (default: all three)
# network: the default network alone (bench_network.py); start: where a gpu server's start goes (probe_start.py);
# job: the whole job as a user types it, on 100,000 files (bench_job.py via job.sh), the default and the
# in-process engine side by side. Results under $OUT/f (network) and $OUT/j (job).
set -u
source "$HOME/env/activate.sh"
parts=${*:-network start job}
mkdir -p "$OUT/f"
for part in $parts; do
  case $part in
    network) timeout 200 python3 tests/benchmarks/bench_network.py --out "$OUT/f" --budget-s 150 > "$OUT/f/network.log" 2>&1
             echo "bench_network rc=$?"; grep -v "^[0-9-]* [0-9:,]* " "$OUT/f/network.log" | tail -25 ;;
    start)   timeout 120 python3 tests/benchmarks/device/probe_start.py 6 2>&1 | tail -30 ;;
    job)     bash tests/benchmarks/device/job.sh --images 100000 --timeout-s 200 ${JOB_VARIANTS:---variant default= --variant inproc=--engine=gpu} ;;
  esac
done
