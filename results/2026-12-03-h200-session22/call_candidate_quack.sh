#!/usr/bin/env bash
# Session 22 (issue 25), the last of three back-to-back calls: QuACK's wheels staged in /tmp/qstage by the two
# calls before (cp .whlqa/* .whlqb/* there), this call adds .whlqc/ and runs the smallheads-busy stage on the
# candidate rule's wheel (.whlc/: the H200 ws_inner rule = slab_budget 5GiB) with QuACK. Output tarred into $OUT.
set -uo pipefail
mkdir -p /tmp/qstage && cp .whlqc/* /tmp/qstage/
cp .whlc/*.whl .whl/
QUACK_WHEELS=/tmp/qstage OUT=/tmp/o timeout 520 bash benchmarks/run_gpu_suite.sh smallheads-busy > /tmp/o_stage.log 2>&1
echo "stage rc $?"
mkdir -p /tmp/o && cp /tmp/o_stage.log /tmp/o/smallheads_busy_stage.log
tar czf $OUT/candidate_quack.tgz -C /tmp o
grep -E "x floor|ours_default|quack|liger_c16|grad_" /tmp/o_stage.log | grep -v "━" | tail -60
