#!/usr/bin/env bash
# Session 23 (issue 26), one call on the H200, main's wheel (.whl/): the trained stage's rows cut to what this session
# asks (the device budget was short): the trained inputs rebuilt; on them and on random logits (std 4) of their shape
# the dense default, the rescued filters around 2**-13.5 and 2**-12 without rescue, and Liger C=16, interleaved behind
# a sleep kernel, 7 repeats, with their accuracy on the trained inputs; first benchmarks/filter_rest.py at two shapes,
# 5 rounds (runs of calls on random logits: the policy's rest). Logs straight into $OUT. Run from the checkout root.
set -uo pipefail
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.whl/*.whl || exit 1
cd /tmp
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
timeout 100 python3 -m flce_policy.benchmarks.filter_rest --shapes 16384x1152x262144 16384x1024x131072 --rounds 5 \
  --out /tmp/tr/filter_rest.json > $OUT/filter_rest.log 2>&1
timeout 230 python3 -m flce_policy.benchmarks.trained_inputs --out /tmp/tr > $OUT/trained_inputs.log 2>&1
methods=(ours_default_bf16 ours_filter12_bf16 ours_filter13_rescue16_bf16 ours_filter13.5_rescue16_bf16
  ours_filter14_rescue16_bf16 liger_c16_bf16)
for inputs in trained random; do
  if [ "$inputs" = trained ]; then pick=(--inputs trained); else pick=(--shapes 16384x1024x131072); fi
  timeout 100 python3 -m flce_policy.cli bench --busy-start --interleave --repeats 7 "${pick[@]}" \
    --methods "${methods[@]}" --out /tmp/tr/bench-$inputs > $OUT/bench-$inputs.log 2>&1
  [ "$inputs" = trained ] && timeout 60 python3 -m flce_policy.benchmarks.accuracy "${pick[@]}" \
    --methods "${methods[@]}" --out /tmp/tr/accuracy-$inputs.json 2>&1 | tail -12 >> $OUT/accuracy.log
done
tar czf $OUT/json.tgz -C /tmp/tr trained_inputs.json accuracy-trained.json bench-trained \
  bench-random filter_rest.json
