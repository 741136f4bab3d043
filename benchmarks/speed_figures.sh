#!/usr/bin/env bash
# Issue 16's speed figures: each benchmark once, one after the other, with the machine's
# load before and after each (the README rows marked (*) come from one such run).
#     bash benchmarks/speed_figures.sh [OUT_DIR]    (default benchmarks/results/speed)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${1:-benchmarks/results/speed}"
mkdir -p "$OUT"
run() {
    local name=$1; shift
    {
        echo "## $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
        echo "\$ $*"
        timeout 900 "$@"
        echo "rc=$? load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    } > "$OUT/$name.txt" 2>&1
    tail -n 12 "$OUT/$name.txt"
}
run manager python benchmarks/bench_kv_cache_manager.py
run contention python benchmarks/bench_contention.py --procs 1,8 --seconds 1 --rounds 3 --plot ""
run run_defaults python -m shmkv.cli run --json "$OUT/run.json" --plot ""
run block_table python benchmarks/bench_block_table.py --scenarios decode --repeats 11 --steps 20
run recovery python benchmarks/bench_recovery.py --partial-keys --repeats 5
run block_pool python benchmarks/bench_block_pool.py --ops alloc_free --no-progress
run python_floor python benchmarks/bench_python_floor.py
