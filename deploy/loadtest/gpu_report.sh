#!/usr/bin/env bash
# The GPU checks and figures in one run, each step's output also saved in OUT_DIR:
#   1. the GPU tests (the float32 oracle of CUDA graphs and the Triton kernels, the kernels against torch's ops);
#   2. the whole stack with one worker (on torch's ops, then on the Triton kernels), then with two workers sharing
#      the GPU: one stream against the engine alone, and 64 streams (bench_stack.py, 256 tokens each);
#   3. engine_report.py's engine figures: torch's ops and the Triton kernels against transformers.generate, the
#      default model's shapes and Llama-1B's at batch 1/16/64/256, each beside its target.
# MODEL_DIR holds a model's config and tokenizer (`engine_report.py --save-model DIR` writes the default model's);
# the weights are random. Usage: deploy/loadtest/gpu_report.sh MODEL_DIR [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
model=$(realpath "${1:?usage: $0 MODEL_DIR [OUT_DIR]}")
out=${2:-.}
py=${PYTHON:-python3}
export TILLER_DEVICE=cuda TILLER_MODEL="random:$model" PYTHONUNBUFFERED=1
status=0
"$py" -m pytest -q -p no:cacheprovider tests/worker/test_worker_cuda.py tests/worker/test_triton_ops.py 2>&1 \
  | tee "$out/gpu_tests.log" || status=1
# one worker on torch's ops, on the Triton kernels, then two workers sharing the device (the gpu_kernels setting,
# default torch); each worker sizes its KV pool from the memory free when it starts: two are held to 40% each
for run in "1 torch" "1 triton" "2 ${TILLER_GPU_KERNELS:-torch}"; do
  read -r workers kernels <<<"$run"
  TILLER_DISTRIBUTED__LOCAL_WORKERS=$workers TILLER_GPU_KERNELS=$kernels TILLER_LIMITS__KV_MEMORY_FRACTION=0.4 \
    "$py" deploy/loadtest/bench_stack.py --tokens 256 --streams 64 2>&1 \
    | tee "$out/stack_${workers}_workers_$kernels.log" || status=1
done
"$py" deploy/loadtest/engine_report.py --no-stack 2>&1 | tee "$out/engine_report.log" || status=1
exit $status
