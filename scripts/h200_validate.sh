#!/usr/bin/env bash
# One device call that validates and measures everything GPU-only, writing to $OUT
# (the device tool's output folder) or ./h200_out. Sections can be picked:
#   bash scripts/h200_validate.sh tests kernels sampler e2e weights
# Run from the repo root on the H200; ROLLOUT_GIT_COMMIT should be passed in (no .git there).
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
sections=${*:-tests kernels sampler e2e weights}
for s in $sections; do
  case $s in
    tests)    # correctness first: bf16 vs HF, the stream pipeline, kernels, fused sampler
      ROLLOUT_GPU_REPORT=$OUT/gpu_tests.jsonl timeout 420 python3 -m pytest -q -p no:cacheprovider --noconftest \
        tests/gpu 2>&1 | tail -40 | tee $OUT/gpu_tests.log ;;
    kernels)  timeout 240 python3 -m rollout.bench.kernels --out $OUT/kernels.json 2>&1 | tail -25 ;;
    sampler)  timeout 120 python3 -m rollout.bench.sampler --out $OUT/sampler.json 2>&1 | tail -15 ;;
    e2e)      # sync vs async vs HF, with a timeline; then the 8B bf16 drift check in fp32
      timeout 300 python3 -m rollout.bench --shape qwen2.5-0.5b --batch 64 --prompt-len 128 --gen-len 512 \
        --modes sync,async --trace $OUT/timeline_q05 --out $OUT/e2e_q05.json 2>&1 | tail -8
      timeout 300 python3 -m rollout.bench --shape llama3-8b --batch 16 --prompt-len 128 --gen-len 64 \
        --dtype float32 --skip-hf --out $OUT/l8b_fp32_check.json 2>&1 | grep -E "^check" ;;
    weights)  timeout 300 python3 -m rollout.bench.weights --shape llama3-8b --batch 32 --gen-len 128 \
        --update-at-step 64 --out $OUT/weights_l8b.json 2>&1 | tail -5 ;;
  esac
done
