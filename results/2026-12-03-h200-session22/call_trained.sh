#!/usr/bin/env bash
# Session 22 (issue 26), one call on the H200: main's wheel (.whl/: 32-row tiles, the 5 GiB small-head rule) against
# branch levelguard's (.whlg/: a rescue level without tiles skips its loop). The kernel probe on each; the trained
# inputs rebuilt; the rescued filters benched main / guard / main; then the trained stage's rows (trained and random
# logits, time and accuracy) on the guard's wheel. Logs straight into $OUT. Run from the checkout root.
set -uo pipefail
R=$PWD
for w in main g; do
  rm -rf /tmp/site_$w && mkdir -p /tmp/wh_$w && cp $R/.whl/*.whl /tmp/wh_$w/
  [ $w = g ] && cp $R/.whlg/*.whl /tmp/wh_$w/
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_$w /tmp/wh_$w/*.whl || exit 1
done
cd /tmp
export PYTHONUNBUFFERED=1
for w in main g; do
  PYTHONPATH=/tmp/site_$w timeout 60 python3 $R/results/2026-12-03-h200-session22/rescue_probe/rescue_probe.py 1024 131072 \
    2>&1 | grep -v Warn | sed "s/^/[$w] /" >> $OUT/probe.log
done
PYTHONPATH=/tmp/site_main timeout 200 python3 -m flce_policy.benchmarks.trained_inputs --out /tmp/tr > $OUT/trained_inputs.log 2>&1
methods=(ours_default_bf16 ours_filter13_bf16 ours_filter12_rescue16_bf16 ours_filter13_rescue16_bf16 ours_filter14_rescue16_bf16)
for w in main g main; do
  echo "== wheel $w" >> $OUT/bench_ab.log
  PYTHONPATH=/tmp/site_$w timeout 90 python3 -m flce_policy.cli bench --busy-start --interleave --repeats 9 --inputs trained \
    --methods "${methods[@]}" --out /tmp/tr/ab-$w 2>&1 | grep -E "^│ 16384" >> $OUT/bench_ab.log
done
full=(ours_default_bf16 ours_scaled_exp_bf16 'ours_filter*' liger_c16_bf16 'cce*')
for inputs in trained random; do
  if [ "$inputs" = trained ]; then pick=(--inputs trained); else pick=(--shapes 16384x1024x131072); fi
  PYTHONPATH=/tmp/site_g timeout 110 python3 -m flce_policy.cli bench --busy-start --interleave --repeats 9 "${pick[@]}" \
    --methods "${full[@]}" --out /tmp/tr/bench-$inputs > $OUT/bench-$inputs.log 2>&1
  PYTHONPATH=/tmp/site_g timeout 60 python3 -m flce_policy.benchmarks.accuracy "${pick[@]}" --methods "${full[@]}" \
    --out /tmp/tr/accuracy-$inputs.json 2>&1 | tail -20 >> $OUT/accuracy.log
done
tar czf $OUT/json.tgz -C /tmp/tr trained_inputs.json accuracy-trained.json accuracy-random.json bench-trained bench-random
