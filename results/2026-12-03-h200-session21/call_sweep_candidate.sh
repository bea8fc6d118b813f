#!/usr/bin/env bash
# Session 21 (issue 25), one call: chunk_sweep.py on main's wheel (.whl/), then the smallheads-busy stage on the
# candidate rule's wheel (.whlc/: ws_inner = slab_budget 5GiB), without QuACK. Logs straight into $OUT.
set -uo pipefail
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
(cd /tmp && PYTHONPATH=/tmp/site timeout 150 python3 $R/results/2026-12-03-h200-session21/chunk_sweep.py > $OUT/chunk_sweep.log 2>&1)
rm -rf /tmp/site && cp .whlc/*.whl .whl/
OUT=/tmp/cand bash benchmarks/run_gpu_suite.sh smallheads-busy > /tmp/cand_stage.log 2>&1
grep -E "x floor|ours_|gemm_floor|liger|quack|grad_input" /tmp/cand_stage.log | grep -v "━" > $OUT/candidate_smallheads.log
cp /tmp/cand/small_heads_busy/bench.json $OUT/candidate_bench.json
