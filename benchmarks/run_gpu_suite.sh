#!/usr/bin/env bash
# The GPU half of the project, in one script, for the GPU the device tool lends (H100 or H200):
#   bash benchmarks/run_gpu_suite.sh [tests] [bench] [smallheads] [smallheads-busy] [smallheads-sustained] [compile] [hf] [sharded] [trained] [convergence] [overlap] [weightgrad] [measured] [measured-first]
#     [quick METHODS SHAPES...]
# (smallheads: the small- and large-head shape sets against QuACK and Liger, and the accuracy table;
# QuACK is installed by benchmarks/install_quack.sh from $QUACK_WHEELS (default .whl/quack/; its largest wheel
# may come as split parts) when it is not importable, without them its rows say it is not installed; smallheads-busy: the same
# shapes for the default, both picks at Liger C=16's peak, QuACK and Liger C=16 and C=1 with bench --busy-start, and
# the accuracy table; smallheads-sustained: the default, QuACK and Liger C=16 at the shape sets of $SUSTAINED_SHAPES
# (default both) with bench --sustained 1.5, calls back to back as in training — the README's tables)
# (compile: the torch.compile GPU tests and benchmarks/compile_bench.py alone; hf: the HF step
# benchmark and the 50-step check; sharded: FSDP2 / ZeRO-3 on one GPU and the saturation scenario,
# with DeepSpeed's wheels in .whl/ds/ — see docs/fsdp-zero3.md; trained: train the small Llama of
# benchmarks/trained_inputs.py, report its logits, then bench issue 26's methods on its held-out inputs, all in
# $OUT/trained — one call, since the cache it builds lives on the machine only, and the same rows on
# random logits, then the rescue schemes priced on those inputs (benchmarks/rescue_schemes.py); convergence: the model trained with grad_weight_filter off and on, alternating, CONVERGENCE_RUNS_PER_ARM (2) each,
# CONVERGENCE_STEPS steps each, at CONVERGENCE_FILTER (default 2**-12), with CONVERGENCE_RESCUE's rescue if set;
# overlap: the logits rows at 256, 512, 1024 and 2048 rows with and without grad_weight's GEMM on a side stream
# (Geometry.overlap_weight_grad), with bench --busy-start, interleaved, 7 repeats, at 8192x5376x262144 and
# 32768x5376x262144, then tests/test_gpu_overlap_weight_grad.py, benchmarks/chunk_gemm_bound.py (with --stagger 3) and
# profile_chunks.py;
# weightgrad: benchmarks/weight_grad_gemm_bench.py (grad_weight's GEMM per chunk and in the loss, Gluon against cuBLAS)
# and tests/test_gpu_weight_grad_gemm.py; measured: benchmarks/measured_policy.py's checks,
# the nine shapes and the first calls, with this GPU's rules removed; measured-first: the first calls alone)
# Expects wheels in .whl/ (ours, built with `python -m build --wheel -o .whl`, plus the peers
# liger-kernel and cut-cross-entropy, and pydantic's wheels where the machine lacks it: benchmarks/README.md); installs
# them into /tmp/site and runs from outside the
# checkout so the installed package (with its package-dir mapping) is what gets imported.
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/flce-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cd /tmp || exit 1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
status=0
quack_path() {  # QuACK on PYTHONPATH for the stages that bench it, installed once per machine
  # the module the bench imports, not just `quack`: from /tmp an earlier install's /tmp/quack folder imports as an
  # empty namespace package
  python3 -c "import quack.linear_cross_entropy" 2>/dev/null && return 0
  local wheels=${QUACK_WHEELS:-$repo/.whl/quack}
  [ -d "$wheels" ] || { echo "QuACK: no wheels in $wheels, its rows will say it is not installed"; return 0; }
  local entries
  entries=$(bash "$repo/benchmarks/install_quack.sh" "$wheels") || { echo "QuACK: install failed"; return 0; }
  export PYTHONPATH=$PYTHONPATH:$entries
}
while [ $# -gt 0 ]; do
  case "$1" in
    tests)
      TRITON_INTERPRET=0 FLCE_GPU_REPORT="$out/gpu_tests.jsonl" python3 -m pytest "$repo/tests" -m gpu -s -q -p no:cacheprovider --continue-on-collection-errors \
        --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" || status=1
      # the scaled-exp slab's option tests (the interpreter's shapes), compiled on CUDA: every option on the GPU
      TRITON_INTERPRET=0 python3 -m pytest "$repo/tests/test_scaled_exp.py" "$repo/tests/test_row_scaled_finish.py" -q \
        -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_scaled_exp_options.log" || status=1
      # the filtered grad_weight kernel's launches (TMA wide and narrow, pointer-based) against fp64, with and without
      # the rescue, the rescue at the loss and the policy's rest, compiled
      TRITON_INTERPRET=0 python3 -m pytest "$repo/tests/test_weight_grad_filter_kernel.py" \
        "$repo/tests/test_weight_grad_filter_rescue.py" "$repo/tests/test_weight_grad_filter_rest.py" -q -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_filter_kernel.log" || status=1
      shift ;;
    bench)
      python3 -m flce_policy.cli bench --out "$out" || status=1
      shift ;;
    smallheads)
      quack_path
      # rows interleaved per shape (one call of each per round): a drift over a shape reaches every row alike
      python3 -m flce_policy.cli bench --interleave --repeats 7 --shapes small-heads large-heads --out "$out/small_heads" --methods \
        ours_default_bf16 ours_scaled_exp_bf16 ours_within_liger_c16_peak_bf16 ours_within_liger_c16_peak_rows_bf16 quack liger_c16_bf16 liger_c1_bf16 2>&1 | tee "$out/small_heads.log" || status=1
      python3 -m flce_policy.benchmarks.accuracy --out "$out/accuracy.json" 2>&1 | tee "$out/accuracy.log" || status=1
      shift ;;
    smallheads-busy)
      # the same rows with each timed call behind a sleep kernel (bench --busy-start), as inside a training step
      quack_path
      python3 -m flce_policy.cli bench --busy-start --interleave --repeats 7 --shapes small-heads large-heads --out "$out/small_heads_busy" --methods \
        ours_default_bf16 ours_within_liger_c16_peak_bf16 ours_within_liger_c16_peak_rows_bf16 quack liger_c16_bf16 \
        liger_c1_bf16 2>&1 | tee "$out/small_heads_busy.log" || status=1
      python3 -m flce_policy.benchmarks.accuracy --out "$out/accuracy.json" 2>&1 | tee "$out/accuracy.log" || status=1
      shift ;;
    smallheads-sustained)
      # each sample the mean call over 1.5 s of calls back to back: the card at its sustained clock, as in training
      quack_path
      # shellcheck disable=SC2086  # the shape sets are words
      python3 -m flce_policy.cli bench --sustained 1.5 --interleave --repeats 5 --shapes ${SUSTAINED_SHAPES:-small-heads large-heads} \
        --out "$out/small_heads_sustained" --methods ours_default_bf16 quack liger_c16_bf16 2>&1 \
        | tee "$out/small_heads_sustained.log" || status=1
      shift ;;
    compile)
      TRITON_INTERPRET=0 python3 -m pytest "$repo/tests/test_gpu_compile.py" -m gpu -s -q -p no:cacheprovider 2>&1 | tee "$out/gpu_compile_tests.log" || status=1
      python3 -m flce_policy.benchmarks.compile_bench "$out/compile_bench.json" 2>&1 | tee "$out/compile_bench.log" || status=1
      shift ;;
    hf)
      python3 -m flce_policy.benchmarks.hf_train_check --out "$out" 2>&1 | tee "$out/hf_train_check.log" || status=1
      python3 -m flce_policy.benchmarks.hf_step --out "$out" 2>&1 | tee "$out/hf_step.log" || status=1
      shift ;;
    sharded)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site --find-links "$repo/.whl/ds" \
        deepspeed hjson einops py-cpuinfo msgpack || exit 1
      TRITON_INTERPRET=0 python3 "$repo/benchmarks/sharded_heads.py" "$out/sharded" --noise-floor 2>&1 | tee "$out/sharded_heads.log" || status=1
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TRITON_INTERPRET=0 python3 "$repo/benchmarks/zero3_saturation.py" \
        "$out/z3s" 2>&1 | tee "$out/zero3_saturation.log" || status=1
      shift ;;
    trained)
      d="$out/trained"
      mkdir -p "$d"
      python3 -m flce_policy.benchmarks.trained_inputs --out "$d" 2>&1 | tee "$d/trained_inputs.log" || status=1
      # issue 26's rows (the floor always runs) on the trained model's held-out inputs, then on random
      # logits (std 4) of the same shape, where nothing is skippable; time and peak, then the errors. Rows
      # interleaved, each call behind a sleep kernel as in a training step: back to back, the floor alone moved
      # 8% between two runs an hour apart (H200, 2026-12-02)
      methods=(ours_default_bf16 ours_scaled_exp_bf16 'ours_filter*' liger_c16_bf16 'cce*')
      for inputs in trained random; do
        if [ "$inputs" = trained ]; then pick=(--inputs trained); else pick=(--shapes 16384x1024x131072); fi
        python3 -m flce_policy.cli bench --busy-start --interleave --repeats 9 "${pick[@]}" --methods "${methods[@]}" \
          --out "$d/bench-$inputs" 2>&1 \
          | tee "$d/bench-$inputs.log" || status=1
        python3 -m flce_policy.benchmarks.accuracy "${pick[@]}" --methods "${methods[@]}" \
          --out "$d/accuracy-$inputs.json" 2>&1 | tee "$d/accuracy-$inputs.log" || status=1
      done
      # random logits over runs of calls: a policy's filtered calls rest (dense, no flags) after flags that bought nothing
      python3 -m flce_policy.benchmarks.filter_rest --out "$d/filter_rest.json" 2>&1 | tee "$d/filter_rest.log" || status=1
      # the filter's ways of treating its dropped tiles (skip, uniform rescue, rescue by level), priced exactly
      python3 -m flce_policy.benchmarks.rescue_schemes --inputs trained --accuracy "$d/accuracy-trained.json" \
        --out "$d/rescue_schemes.json" 2>&1 | tee "$d/rescue_schemes.log" || status=1
      shift ;;
    convergence)
      # trainings of the trained-inputs model from one seed, filter off and on ($CONVERGENCE_FILTER, 2**-12 by default) alternating, 2 of each by default
      python3 -m flce_policy.benchmarks.convergence --out "$out/convergence" ${CONVERGENCE_STEPS:+--steps "$CONVERGENCE_STEPS"} ${CONVERGENCE_RUNS_PER_ARM:+--runs-per-arm "$CONVERGENCE_RUNS_PER_ARM"} ${CONVERGENCE_FILTER:+--filter "$CONVERGENCE_FILTER"} ${CONVERGENCE_RESCUE:+--rescue "$CONVERGENCE_RESCUE"} \
        2>&1 | tee "$out/convergence.log" || status=1
      shift ;;
    overlap)
      rows=()
      for chunk in 256 512 1024 2048; do rows+=("ours_chunk${chunk}_bf16" "ours_overlap_chunk${chunk}_bf16"); done
      python3 -m flce_policy.cli bench --busy-start --interleave --repeats 7 --shapes 8192x5376x262144 32768x5376x262144 \
        --methods "${rows[@]}" --out "$out/overlap" 2>&1 | tee "$out/overlap.log" || status=1
      TRITON_INTERPRET=0 python3 -m pytest "$repo/tests/test_gpu_overlap_weight_grad.py" -m gpu -s -q -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_overlap_tests.log" || status=1
      # the GEMMs alone at the same chunks: serial, overlapped, grad_input split over vocab slices (a lower bound each)
      python3 -m flce_policy.benchmarks.chunk_gemm_bound 8192x5376x262144 256 512 1024 2048 --busy-start 2>&1 \
        | tee "$out/chunk_gemm_bound.log" || status=1
      # and grad_weight's update staggered over 3 vocab groups (K 3 chunks, 2 chunks of logits held), sustained
      python3 -m flce_policy.benchmarks.chunk_gemm_bound 8192x5376x262144 128 256 512 1024 --split-k --stagger 3 \
        --sustained 1.5 2>&1 | tee "$out/chunk_gemm_stagger.log" || status=1
      python3 -m flce_policy.benchmarks.profile_chunks 8192x5376x262144 256 512 2048 2>&1 | tee "$out/profile_chunks.log" || status=1
      shift ;;
    weightgrad)
      # grad_weight's per-chunk GEMM on cuBLAS and on the Gluon kernel, alone and in the loss at small chunks, then its tests
      python3 -m flce_policy.benchmarks.weight_grad_gemm_bench --gemm 262144x5376 128256x4096 --rows 128 256 384 512 640 1024 \
        --loss 8192x5376x262144 --chunks 256 512 1024 --repeats 7 2>&1 | tee "$out/weight_grad_gemm.log" || status=1
      TRITON_INTERPRET=0 python3 -m pytest "$repo/tests/test_gpu_weight_grad_gemm.py" -m gpu -q -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_weight_grad_gemm_tests.log" || status=1
      shift ;;
    measured)
      # measured on this GPU standing for an unknown one (its rules removed), against its rule: the nine shapes after
      # the warm-up, then the first calls of a fresh process each side and a second process on the cache; the first
      # calls' inputs: MEASURED_INPUTS (random, default, at 16384x1024x131072; or trained: builds the small Llama first)
      # MEASURED_PAIRS (3) fresh-process pairs; MEASURED_TRITON_CACHE cold (default) or rule-warm
      python3 -m flce_policy.benchmarks.measured_policy --checks shapes --calls 20 --out "$out/measured_shapes" 2>&1 \
        | tee "$out/measured_shapes.log" || status=1
      set -- measured-first "${@:2}" ;;  # then its first calls
    measured-first)
      # the first calls alone (the measured stage's second half)
      if [ "${MEASURED_INPUTS:-random}" = random ]; then first=(--inputs random --first-shape 16384x1024x131072); else first=(--inputs "$MEASURED_INPUTS"); fi
      first+=(--pairs "${MEASURED_PAIRS:-3}" --triton-cache "${MEASURED_TRITON_CACHE:-cold}")
      python3 -m flce_policy.benchmarks.measured_policy --checks first-calls "${first[@]}" --out "$out/measured_first_calls" 2>&1 \
        | tee "$out/measured_first_calls.log" || status=1
      shift ;;
    quick)
      python3 -m flce_policy.benchmarks.quick "$2" "${@:3}" 2>&1 | tee "$out/quick.log" || status=1
      shift $# ;;
    *) echo "unknown stage $1"; exit 2 ;;
  esac
done
exit $status
