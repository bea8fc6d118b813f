#!/usr/bin/env bash
# Session 21 (issue 26): the filter at 32-row tiles (branch rows32's wheel, .whlr/) against 64 (main's, .whl/) on the
# trained inputs: the same methods, one process per wheel (FILTER_ROWS is a module constant), main first, then rows32,
# then main again (drift). Writes logs only to $OUT. Run from the checkout root on the H200.
set -uo pipefail
R=$PWD
methods=(ours_default_bf16 ours_filter13_bf16 ours_filter13_rescue16_bf16 ours_filter14_rescue16_bf16)
for w in main r32; do
  rm -rf /tmp/site_$w && mkdir -p /tmp/wh_$w && cp $R/.whl/*.whl /tmp/wh_$w/
  [ $w = r32 ] && cp $R/.whlr/*.whl /tmp/wh_$w/
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_$w /tmp/wh_$w/*.whl || exit 1
done
cd /tmp
PYTHONPATH=/tmp/site_main timeout 250 python3 -m flce_policy.benchmarks.trained_inputs --out /tmp/tr > $OUT/trained_inputs.log 2>&1
for w in main r32 main; do
  PYTHONPATH=/tmp/site_$w python3 -c "from flce_policy.plan.weight_filter import FILTER_ROWS; print('FILTER_ROWS', FILTER_ROWS)" >> $OUT/bench.log
  PYTHONPATH=/tmp/site_$w timeout 120 python3 -m flce_policy.cli bench --busy-start --interleave --repeats 9 --inputs trained \
    --methods "${methods[@]}" --out /tmp/tr/bench-$w 2>&1 | grep -E "FILTER|ours_|floor" >> $OUT/bench.log
done
for w in main r32; do
  PYTHONPATH=/tmp/site_$w timeout 120 python3 -m flce_policy.benchmarks.accuracy --inputs trained --methods "${methods[@]}" \
    --out /tmp/tr/acc-$w.json 2>&1 | tail -6 >> $OUT/accuracy.log
done
