#!/usr/bin/env bash
# GPU validation and benchmarks in one device call, writing to $OUT (the device tool's output
# folder) or ./h200_out. Run from the repo root; pass ROLLOUT_GIT_COMMIT (the device copy has no .git).
#   bash scripts/h200_validate.sh tests p1            # the default: GPU tests, then P1
# Sections: tests tests_files seed p1 p3 p5 profile sampler gemm weights pressure invariant
#           serve serve_ipc multiturn colocated spec_trained rl_step moe moe_tiles moe_profile moe_gap
#           fleet_scaling fleet_broadcast (the last two on several GPUs)
# Wheels the machine lacks (the server, openai, TRL): scripts/gpu_wheels.sh fills .whl/ here; carry ".whl".
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"; export OUT
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,power.draw --format=csv,noheader
B="python3 -m rollout.bench"
P1="--shape llama3-8b --batch 32 --prompt-len 256 --gen-len 8192"
PYTEST="python3 -m pytest -q -p no:cacheprovider --noconftest"
for s in ${*:-tests p1}; do
  t0=$(date +%s)
  case $s in
    tests)      # correctness first: every GPU test (bf16 vs HF, pipeline, graphs, kernels, sampler, ...)
      ROLLOUT_GPU_REPORT=$OUT/gpu_tests.jsonl timeout 570 $PYTEST tests/gpu > $OUT/gpu_tests.log 2>&1
      grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -30 ;;
    tests_files)  # only $TEST_FILES (space-separated paths or node ids under tests/gpu)
      ROLLOUT_GPU_REPORT=$OUT/gpu_tests.jsonl timeout ${TESTS_TIMEOUT:-570} $PYTEST $TEST_FILES > $OUT/gpu_tests_files.log 2>&1
      grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests_files.log | tail -20 ;;
    seed)       # the seed job: sync vs async vs HF generate_batch, with a timeline
      timeout 590 $B $P1 --modes sync,async --check-seqs 2 --check-gen-len 64 --hf generate_batch --hf-gen-len 512 \
        --trace $OUT/timeline_seed --out $OUT/seed_l8b_B32_G8192.json 2>&1 | grep -A12 "^roofline" ;;
    p1)         # P1 (async, against the roofline); P1_ARGS e.g. --pack-decode-weights, TAG a file suffix
      timeout 300 $B $P1 --modes async --hf none ${P1_ARGS:-} --out $OUT/p1_l8b_B32_G8192${TAG:-}.json 2>&1 \
        | grep -A8 "^roofline" ;;
    p3)         timeout 400 $B --shape qwen2.5-1.5b --batch 64 --n 8 --prompt-len 256 --gen-len 4096 --modes async \
        --hf none --out $OUT/p3_q15_64x8_G4096${TAG:-}.json 2>&1 | grep -A8 "^roofline" ;;
    p5)         timeout 400 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 16384 --modes async --hf none \
        --out $OUT/p5_l8b_B32_G16384.json 2>&1 | grep -A8 "^roofline" ;;
    profile)    # per-step kernel breakdown at P1's mean context (256 + 8192 / 2)
      timeout 200 python3 -m rollout.bench.profile --shape llama3-8b --batch 32 --context 4352 \
        --out $OUT/profile_l8b_B32_C4352.json 2>&1 | grep -A26 "^| part" ;;
    sampler)    timeout 150 python3 -m rollout.bench.sampler --out $OUT/sampler.json 2>&1 | tail -15 ;;
    gemm)       timeout 200 python3 -m rollout.bench.gemm --shape llama3-8b --out $OUT/gemm_l8b.json 2>&1 | tail -30 ;;
    weights)    # an 8B weight update during async decode: staging time and the compute-stream barrier
      timeout 300 python3 -m rollout.bench.weights --shape llama3-8b --batch 32 --gen-len 128 \
        --update-at-step 64 --out $OUT/weights_l8b.json 2>&1 | tail -5 ;;
    pressure)   # KV for 55% of B=64 x G=8192: preemptions, all complete, throughput and greedy outputs against enough KV
      timeout 590 python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 --gen-len 8192 \
        --kv-fraction 0.55 --out $OUT/pressure_l8b_B64_G8192.json > $OUT/pressure.log 2>&1; tail -12 $OUT/pressure.log ;;
    invariant)  # batch-invariant mode: its GPU tests, then P1 under it (what bit-stable outputs cost)
      timeout 400 $PYTEST tests/gpu/test_batch_invariant_cuda.py > $OUT/gpu_tests_invariant.log 2>&1
      grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests_invariant.log | tail -10
      timeout 300 $B $P1 --modes async --hf none --batch-invariant --out $OUT/p1_l8b_B32_G8192_invariant.json 2>&1 \
        | grep -A4 "^roofline" ;;
    serve)      # the P3 workload over HTTP (streaming) against in-process, and an 8B weight update by CUDA IPC
      timeout ${SERVE_TIMEOUT:-590} python3 -m rollout.bench.serve ${SERVE_ARGS:-} --out $OUT/serve_p3.json > $OUT/serve.log 2>&1
      grep -v "^\s" $OUT/serve.log | tail -25 ;;
    serve_ipc)  # an 8B update by CUDA IPC through the server while it decodes, beside the same update in-process
      timeout 300 python3 -m rollout.bench.serve ipc --update-after-s 2 --gen-len 2048 --out $OUT/serve_ipc_l8b.json \
        2>&1 | tail -3
      timeout 300 python3 -m rollout.bench.weights --shape llama3-8b --batch 32 --gen-len 128 \
        --update-at-step 64 --out $OUT/weights_l8b.json 2>&1 | tail -3 ;;
    colocated)  # TRL GRPOTrainer with our generator on the one GPU (COLOCATED_ARGS e.g. --variants trl,ours,sleep1)
      timeout 590 python3 -m rollout.bench.colocated --shape qwen2.5-0.5b --steps 3 ${COLOCATED_ARGS:-} \
        --out $OUT/colocated_q05.json > $OUT/colocated.log 2>&1; tail -12 $OUT/colocated.log ;;
    spec_trained)  # a small model trained here, then GRPO groups with speculation off / on, gated and not (SPEC_ARGS, TAG; memory-bound
                   # steps: SPEC_ARGS="--hidden 768 --layers 8 --train-s 90 --widen 4096,14336,32" TAG=_widened)
      timeout 590 python3 -m rollout.bench.spec_trained ${SPEC_ARGS:-} --out $OUT/spec_trained${TAG:-}.json \
        > $OUT/spec_trained${TAG:-}.log 2>&1; tail -14 $OUT/spec_trained${TAG:-}.log ;;
    rl_step)    # R1: 8B, 32 x 8, log-normal lengths under a 16K cap (RL_ARGS e.g. --runs adaptive,0). One call
                # cannot hold all three settings: the next call adds to the first's file, carried in the tree:
                # RL_FROM=bench/results/<file>.json RL_ARGS="--runs 1 --append"
      [ -n "${RL_FROM:-}" ] && cp "$RL_FROM" $OUT/rl_step_l8b.json
      timeout 590 python3 -m rollout.bench.rl_step --shape llama3-8b ${RL_ARGS:-} --out $OUT/rl_step_l8b.json \
        --png $OUT/rl_step_l8b.png > $OUT/rl_step.log 2>&1; tail -8 $OUT/rl_step.log ;;
    moe)        # Qwen3-30B-A3B shape: async and routed-expert capture against the roofline and HF (MOE_BATCH: 32;
                # MOE_ARGS replaces the --modes / --hf defaults)
      timeout 590 $B --shape qwen3-30b-a3b --batch ${MOE_BATCH:-32} --prompt-len 256 --gen-len 4096 --hf-gen-len 64 \
        ${MOE_ARGS:---modes async,routed --hf generate_batch,generate} \
        --out $OUT/moe_q30a3_B${MOE_BATCH:-32}.json > $OUT/moe_B${MOE_BATCH:-32}.log 2>&1
      grep -A12 "^roofline" $OUT/moe_B${MOE_BATCH:-32}.log | tail -14 ;;
    moe_tiles)  # the fused MoE's tiles swept at decode (8 .. 256 tokens) and prefill (4096) sizes
      timeout 400 python3 -m rollout.bench.gemm --shape qwen3-30b-a3b --moe --m 32 256 8 64 128 512 4096 \
        --out $OUT/moe_tiles_q30a3.json 2>&1 | grep -E "^moe|Error" ;;
    moe_profile)  # the Qwen3-30B-A3B decode step at B=32, mean context of G=4096: where the step's time goes
      timeout 300 python3 -m rollout.bench.profile --shape qwen3-30b-a3b --batch ${MOE_BATCH:-32} --context 2304 \
        --out $OUT/profile_q30a3_B${MOE_BATCH:-32}_C2304.json 2>&1 | grep -A26 "^| part" ;;
    moe_gap)    # the bf16 logprob gaps (ours and HF's bf16 forward against an fp32 copy) on 8 of the 48 layers:
                # an fp32 copy of all of Qwen3-30B-A3B (122 GB) does not fit beside the bf16 one
      timeout 200 $B --shape qwen3-30b-a3b --layers 8 --batch 4 --prompt-len 256 --gen-len 128 --modes async \
        --hf none --fp32-reference --out $OUT/moe_gap_q30a3_L8.json > $OUT/moe_gap.log 2>&1; grep "^check" $OUT/moe_gap.log ;;
    multiturn)  # 64 trajectories x 4 turns at the 8B shape, prefix cache on vs off; its overhead on P1
      timeout 590 python3 -m rollout.bench.multiturn ${MULTITURN_ARGS:-} --out $OUT/multiturn_l8b.json 2>&1 | tail -20 ;;
    fleet_scaling)   # P3 per worker on 1 .. all GPUs (the device image has no Ray: install its wheel first)
      timeout 420 python3 -m rollout.bench.fleet scaling --shape qwen2.5-1.5b --prompts-per-worker 64 --n 8 \
        --prompt-len 256 --gen-len 4096 --out $OUT/fleet_scaling_q15.json > $OUT/fleet_scaling.log 2>&1
      grep -E "^[0-9]+ worker|^\| |Error|error" $OUT/fleet_scaling.log | tail -14 ;;
    fleet_broadcast) # 8B weights, trainer on GPU 0 -> workers on the others, over NCCL, during decode
      timeout 280 python3 -m rollout.bench.fleet broadcast --shape llama3-8b --batch 32 --gen-len 6144 \
        --update-after-s 15 --kv-bytes 40000000000 --out $OUT/fleet_broadcast_l8b.json > $OUT/fleet_broadcast.log 2>&1
      grep -E "^broadcast|Error|error" $OUT/fleet_broadcast.log | tail -8 ;;
    *) echo "unknown section $s" ;;
  esac
  echo "[section $s: $(( $(date +%s) - t0 )) s]"
done
