#!/usr/bin/env bash
# Session 24 (issue 26), one call on the H200, main's wheel (.whl/): a second run of the setting the docs now
# recommend. The trained inputs rebuilt; on them the dense default and the rescued filters at 2**-13 / 2**-13.5 /
# 2**-14, interleaved behind a sleep kernel, 9 repeats, with their accuracy. Logs straight into $OUT. Run from the
# checkout root.
set -uo pipefail
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.whl/*.whl || exit 1
cd /tmp
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
timeout 230 python3 -m flce_policy.benchmarks.trained_inputs --out /tmp/tr > $OUT/trained_inputs.log 2>&1
methods=(ours_default_bf16 ours_filter13_rescue16_bf16 ours_filter13.5_rescue16_bf16 ours_filter14_rescue16_bf16)
timeout 120 python3 -m flce_policy.cli bench --busy-start --interleave --repeats 9 --inputs trained \
  --methods "${methods[@]}" --out /tmp/tr/bench-trained > $OUT/bench-trained.log 2>&1
timeout 60 python3 -m flce_policy.benchmarks.accuracy --inputs trained \
  --methods "${methods[@]}" --out /tmp/tr/accuracy-trained.json 2>&1 | tail -12 >> $OUT/accuracy.log
tar czf $OUT/json.tgz -C /tmp/tr trained_inputs.json accuracy-trained.json bench-trained
