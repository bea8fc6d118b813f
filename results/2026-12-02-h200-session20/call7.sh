# the filter's random-logit overhead with the chunk rule, then the GPU filter tests and the compiled option tests
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
R=results/2026-12-02-h200-session20
cp $R/overhead_probe.py /tmp/op.py
repo=$(pwd)
(cd /tmp && PYTHONPATH=/tmp/site timeout 200 python3 op.py 2>&1 | grep -v -i warn | tee $OUT/overhead_probe_rule.log)
(cd /tmp && PYTHONPATH=/tmp/site TRITON_INTERPRET=0 timeout 200 python3 -m pytest $repo/tests/test_gpu_scaled_exp.py $repo/tests/test_gpu_weight_grad_filter.py -m gpu -q -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/gpu_tests_filter.log)
(cd /tmp && PYTHONPATH=/tmp/site TRITON_INTERPRET=0 timeout 250 python3 -m pytest $repo/tests/test_scaled_exp.py $repo/tests/test_row_scaled_finish.py $repo/tests/test_weight_grad_filter_kernel.py $repo/tests/test_weight_grad_filter_rescue.py $repo/tests/test_weight_grad_filter.py -q -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/gpu_compiled_filter.log)
