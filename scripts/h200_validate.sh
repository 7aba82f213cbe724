#!/usr/bin/env bash
# One device call that validates and measures what is GPU-only, writing to $OUT (the device
# tool's output folder) or ./h200_out. Sections can be picked:
#   bash scripts/h200_validate.sh tests kernels sampler q05 l8b_short l8b_fp32 seed p3 p5 weights
#   (issue 7: pressure_ref0 pressure_ref1 pressured pressured_swap pressure_fp32_small; issue 9 on 2+ GPUs:
#   fleet_scaling fleet_broadcast; issue 4: p1_pdl p5_pdl profile_p1 gemm_pdl sampler_trunc tests_sampler one_wave no_trigger attn_early;
#   batch-invariant mode: inv_cost tests_invariant p1_inv pressure_inv_ref0 pressure_inv_ref1 pressured_inv
#   (KV_FRACTION), inv_refs_x2 on 2 GPUs (then pressured_inv with the npz in h200_ref/), inv_x4 on 4 GPUs;
#   clocks and power: power_clocks; hardware counters: ncu_probe)
# Run from the repo root on the H200; ROLLOUT_GIT_COMMIT should be passed in (no .git there).
set -uo pipefail
OUT=${OUT:-h200_out}; mkdir -p "$OUT"; export OUT   # exported: sections may call this script again
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
B="python3 -m rollout.bench"
sections=${*:-tests kernels sampler q05 l8b_short}
for s in $sections; do
  t0=$(date +%s)
  case $s in
    tests_fix) ROLLOUT_GPU_REPORT=$OUT/gpu_tests.jsonl timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest -s \
        tests/gpu/test_graphs_cuda.py::test_second_slot_graphs_cost_little_memory > $OUT/gpu_tests_fix.log 2>&1
      grep -E "passed|failed|FAILED|busy=|reserved bytes|assert" $OUT/gpu_tests_fix.log | tail -12 ;;
    tests)    # correctness first: bf16 vs HF, pipeline, graphs, kernels, fused sampler
      ROLLOUT_GPU_REPORT=$OUT/gpu_tests.jsonl timeout 540 python3 -m pytest -q -p no:cacheprovider --noconftest \
        -s tests/gpu > $OUT/gpu_tests.log 2>&1
      grep -E "passed|failed|FAILED|busy=|peak bytes|barrier_ms" $OUT/gpu_tests.log | tail -30 ;;
    tests_files) # the GPU tests of $TEST_FILES only (space-separated paths under tests/gpu)
      ROLLOUT_GPU_REPORT=$OUT/gpu_tests.jsonl timeout 300 python3 -m pytest -q -p no:cacheprovider --noconftest \
        -s $TEST_FILES > $OUT/gpu_tests_files.log 2>&1
      grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests_files.log | tail -20 ;;
    profile_unfused) timeout 150 python3 -m rollout.bench.profile --shape llama3-8b --batch 32 --context 1024 \
        --no-fused-ops --out $OUT/profile_l8b_B32_C1024_unfused.json 2>&1 | grep -A26 "^| part" ;;
    profile_p1) # per-step breakdown at P1's mean context (256 + 8192 / 2 = 4352), fused path, PDL on
      timeout 200 python3 -m rollout.bench.profile --shape llama3-8b --batch 32 --context 4352 \
        --out $OUT/profile_l8b_B32_C4352.json 2>&1 | grep -A26 "^| part" ;;
    inv_cost) # what batch-invariant mode costs per decode step at P5's mean context (256 + 16384 / 2), and
      # the attention kernels alone: split-KV decode vs the varlen kernel invariant mode uses for decode rows
      # (--invariant-block-m: smaller invariant tiles waste less on decode rows, cost more KV reads in prefill)
      timeout 150 python3 -m rollout.bench.kernels --only decode prefill --shapes 32x8K 32x16K --num-splits 2 \
        --num-stages 3 --block-n 64 --num-warps 1 4 --invariant-split-len 1024 --invariant-block-m 16 32 64 --skip-ref \
        --out $OUT/kernels_decode_vs_varlen.json 2>&1 | grep -E "^decode|auto|varlen|^prefill"
      for f in --batch-invariant; do timeout 150 python3 -m rollout.bench.profile --shape llama3-8b --batch 32 \
        --context 8448 $f --out $OUT/profile_l8b_B32_C8448${f:+_invariant}.json 2>&1 | grep -E "^\| (gemm|attention|\*\*step)"; done ;;
    profile_p1_nopdl) # as profile_p1 with PDL off: kernel spans no longer overlap, so the categories add up
      # (PROFILE_ARGS: e.g. --pack-decode-weights, with TAG=_packed)
      ROLLOUT_PDL=0 timeout 200 python3 -m rollout.bench.profile --shape llama3-8b --batch 32 --context 4352 ${PROFILE_ARGS:-} \
        --out $OUT/profile_l8b_B32_C4352_pdl0${TAG:-}.json 2>&1 | grep -A26 "^| part" ;;
    profile)  # per-step breakdown, fused small ops off and on
      for f in --no-fused-ops ""; do timeout 150 python3 -m rollout.bench.profile --shape llama3-8b --batch 32 \
        --context 1024 $f --out $OUT/profile_l8b_B32_C1024${f:+_unfused}.json 2>&1 | grep -A26 "^| part"; done ;;
    attn_layout) # decode attention at P1's mean context and beyond: KV page order (token- or head-major), page 16/64
      timeout 300 python3 -m rollout.bench.kernels --only decode --shapes 32x4352 32x8K 32x16K --page-size 16 64 \
        --layout token head --num-splits 1 2 3 4 --block-n 32 64 --num-stages 2 3 --num-warps 4 \
        --invariant-split-len --skip-ref --out $OUT/kernels_attn_layout.json > $OUT/kernels_attn_layout.log 2>&1
      python3 scripts/summarize_decode_sweep.py $OUT/kernels_attn_layout.json ;;
    attn_ceiling) # issue 4: decode attention at P1's (4352) and P5's (8448) mean context against a kernel that
      # only reads the same bytes, and cuDNN's dense decode, chained in CUDA graphs; pages shuffled and in order
      for C in ${ATTN_CONTEXTS:-4352 8448}; do timeout 240 python3 -m rollout.bench.attn_ceiling --batch 32 --context $C \
        --configs ${ATTN_CONFIGS:-2,64,4,2 4,64,4,2 2,64,4,3 2,128,8,2 4,32,1,2} --out $OUT/attn_ceiling_B32_C$C.json \
        2>&1 | tail -40; done ;;
    ncu_probe) # issue 4: hardware counters (Nsight Compute) of one launch each: the launch path's attention with
      # and without its math, at 64-key tiles, the pure read; the megakernel's paged K/V stream and its bounds
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
      M="dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,gpu__time_duration.sum"
      NCU_ARGS="--profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis
        --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats --metrics $M --csv
        --page raw"
      timeout 200 $NCU $NCU_ARGS --log-file $OUT/ncu_attn.csv python3 -m rollout.bench.attn_ceiling --probe --layers 1 \
        --pages interleaved --configs ${NCU_ATTN:-gluon=32,6 gluon=32,6,nomath gluon=64,3} --read-grid 2 --read-stages 4 \
        2>&1 | tail -8
      timeout 280 $NCU $NCU_ARGS --log-file $OUT/ncu_mega.csv python3 -m rollout.bench.decode_layers --probe --layers 8 \
        --pages ordered --kv-layout token slab --variants ${NCU_MEGA:-2,6,4 2,6,4,0 2,6,4,2 2,6,4,3} 2>&1 | tail -10
      python3 scripts/ncu_summary.py $OUT/ncu_attn.csv $OUT/ncu_mega.csv ;;
    power_clocks) # issue 4: SM clock and power (nvidia-smi every 50 ms) while the launch path's attention runs with
      # its math and without, the pure read, and P1's decode step (base vs the megakernel, STEPS a window)
      nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > $OUT/smi_q.txt 2>&1
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader -lms 50 > $OUT/smi_power.csv 2>&1 & smi=$!
      timeout 300 python3 -m rollout.bench.attn_ceiling --batch 32 --context 4352 --pages interleaved \
        --configs ${ATTN_CONFIGS:-gluon=32,6 gluon=32,6,nomath gluon=64,3} --read-grid ${READ_GRID:-2} --read-stages 4 \
        --hold ${HOLD:-3} ${ATTN_ARGS:---no-sdpa} --out $OUT/attn_ceiling_hold.json 2>&1 | grep -E "ours|read|sdpa|over"
      [ "${SV:-base mega base}" ] && timeout 300 python3 -m rollout.bench.step_variants --shape llama3-8b --batch 32 \
        --context 4352 --steps ${STEPS:-600} --variants ${SV:-base mega base} --out $OUT/step_variants_power.json \
        2>&1 | grep -A6 "^| variant"
      kill $smi
      python3 -m rollout.bench.clocks $OUT/attn_ceiling_hold.json $OUT/smi_power.csv
      [ -f $OUT/step_variants_power.json ] && python3 -m rollout.bench.clocks $OUT/step_variants_power.json $OUT/smi_power.csv
      grep -iE "limit|draw|event|slowdown|SM  " $OUT/smi_q.txt | head -40 ;;
    variants) # issue 4 P1: the decode step under kernel knobs and GEMM / attention configs, side by side
      V="base wait_first rope_token qkv=cublas qkv=32,128,4,5 qkv=64,128,4,5,2 qkv=64,256,4,4 qkv=32,256,4,4
         qkv=128,128,8,4,2 o=cublas o=64,128,4,5,2 o=32,128,4,5,2 o=16,256,4,5 o=32,256,4,4,2 base
         gate_up=64,128,4,5 gate_up=128,128,8,4 gate_up=64,64,4,4 gate_up=32,128,4,5 down=32,256,4,5
         down=32,128,4,5,2 down=64,128,4,5,4 down=64,256,4,4,2 lm_head=128,128,8,4 lm_head=64,256,4,4
         attn=3,32,4,2 attn=4,64,4,2 attn=2,64,4,3 attn=2,64,8,2 base"
      timeout 560 python3 -m rollout.bench.step_variants --shape llama3-8b --batch 32 --context 4352 --steps ${STEPS:-400} \
        --variants ${VARIANTS:-$V} --out $OUT/step_variants_l8b_B32_C4352.json 2>&1 | grep -A40 "^| variant" ;;
    epilogues) # the SiLU and RoPE GEMM epilogues, on by default since the ninth session: their GPU tests, the
      # fused kernels against the two they replace, then P1 end to end with both off and on
      TEST_FILES="tests/gpu/test_kernels_cuda.py tests/gpu/test_skinny_gemm_cuda.py" bash $0 tests_files
      timeout 120 python3 -m rollout.bench.gemm --shape llama3-8b --epilogues-only --m 32 1 16 64 \
        --out $OUT/gemm_epilogues_l8b.json 2>&1 | grep -E "^NVIDIA|M=|Error"
      TAG=_epilogues0 ROLLOUT_SILU_GATE_UP=0 ROLLOUT_ROPE_QKV=0 bash $0 p1; TAG=_epilogues1 bash $0 p1 ;;
    tree_profile) # P3's regression, tree against tree on one machine: the whole-batch decode-step profile of
      # Qwen2.5-1.5B at 512 x 2304, PDL off (kernel times add up), for this checkout and each folder in $TREES: an
      # older commit's rollout/, made before the call (`mkdir t_<c> && git archive <c> rollout | tar -x -C t_<c>`),
      # run with this checkout's profile.py and timeline.py copied in (older ones timed a partial batch at this size).
      # TREE_ARGS / TREE_NAME: other profile arguments and JSON name (tree_groups)
      here=$PWD
      for t in . ${TREES:-}; do
        c=${t#t_}; [ "$t" = . ] && c=${ROLLOUT_GIT_COMMIT:-head} || cp $here/rollout/bench/{profile,timeline}.py $t/rollout/bench/
        (cd $t && ROLLOUT_GIT_COMMIT=$c ROLLOUT_PDL=0 PYTHONPATH=$PWD timeout 240 python3 -m rollout.bench.profile \
          --shape qwen2.5-1.5b --batch 512 --context 2304 --steps 30 ${TREE_ARGS:-} \
          --out $OUT/profile_q15_${TREE_NAME:-B512_C2304}_pdl0_$c.json 2>&1 | grep -E -A30 "^step ms|Error" | grep -v "^| - Mem")
      done ;;
    tree_groups) # as tree_profile, as P3 runs: 64 prompts of 256 tokens x n = 8 samples sharing the prompt's
      # pages, decoded to context 2304; the per-step curve from the first step, then the profiled window
      TREE_ARGS="--n 8 --prompt-len 256" TREE_NAME=64x8_P256_C2304 bash $0 tree_profile ;;
    compile_stalls) # no Triton compile inside a step after the first request (P3's first run lost ~3 s to 7 of
      # them), P3 end to end (its first 256 steps read 15.5 ms with them against 5.4), then the sampler's GPU tests
      TEST_FILES=tests/gpu/test_compile_stalls_cuda.py bash $0 tests_files
      mv $OUT/gpu_tests_files.log $OUT/gpu_tests_compile_stalls.log
      TAG=${TAG:-_nocompile} bash $0 p3
      TEST_FILES=tests/gpu/test_fused_sampler_cuda.py bash $0 tests_files ;;
    one_wave) # the QKV GEMM's 96 programs (64-row tiles, 144 KB of shared memory: one an SM) leave 36 SMs idle
      # and read at ~74% of copy bandwidth; its split-K configs timed so far ran 192 programs at one an SM, i.e.
      # 1.45 waves. These 192-program configs fit in one wave (sm_90a, ptxas: shared memory / registers ->
      # programs an SM): 64,128,4,3,2 (96 KB: 2), 32,128,4,5 (64 KB: 3), 64,64,4,6,2 (84 KB: 2), 32,256,4,3 (64 KB,
      # 224 registers: 2); 384 programs, 32,128,4,5,2 (3 an SM: at most 3 x 128 KB of weight an SM against 512 KB
      # now, if an SM's own stream is what limits). Packed gate_up's 128,64,8,5 (120 KB: one an SM) runs its 224
      # programs in 1.7 waves; 128,64,8,4 (100 KB) fits two (unpacked, one wave tied: sixteenth session). Packed,
      # 500-step windows; then,
      # if the best gains over 0.3 points (mean vs_base), P1 packed with it (ROLLOUT_SKINNY_CONFIGS)
      STEPS=500 VARIANTS="packed packed+qkv=64,128,4,3,2 packed+qkv=32,128,4,5 packed packed+qkv=64,64,4,6,2
        packed+qkv=32,256,4,3 packed+qkv=32,128,4,5,2 packed packed+gate_up=128,64,8,4 packed" bash $0 variants
      best=$(python3 -c "import json, sys, collections; g = collections.defaultdict(list); \
        [g[r['variant']].append(r['vs_base']) for r in json.load(open(sys.argv[1]))['rows'] if 'vs_base' in r]; \
        v, d = max(((v, sum(d) / len(d)) for v, d in g.items()), key=lambda t: t[1]); print(v, round(100 * d, 2))" \
        $OUT/step_variants_l8b_B32_C4352.json)
      echo "best variant, points: $best"
      set -- $best
      knob=${1#packed+}; shape=$(case ${knob%%=*} in qkv) echo 6144x4096;; gate_up) echo 28672x4096;; esac)
      if [ -n "$shape" ] && python3 -c "import sys; sys.exit(float(sys.argv[1]) <= 0.3)" "$2"; then
        ROLLOUT_SKINNY_CONFIGS="$shape=${knob#*=}" TAG=_packed_${knob%%=*} P1_ARGS=--pack-decode-weights bash $0 p1
      fi ;;
    no_trigger) # does the early (PDL) launch behind the QKV GEMM carry its idle SMs' worth? Every way of filling
      # QKV's 36 idle SMs lost ~0.5 points (twenty-fifth session). Packed 500-step windows with QKV (then
      # attention) never letting the next kernel launch before it exits (pdl.set_no_trigger; right results)
      STEPS=500 VARIANTS="packed packed+no_trigger packed packed+no_trigger=attn packed packed+no_trigger packed" \
        bash $0 variants ;;
    attn_early) # decode attention issuing its first K / V tiles before its PDL wait (paged_decode.GLUON_EARLY):
      # the programs that launch early (QKV leaves 36 SMs idle; more as its CTAs drain) start their stream
      # while the GEMM runs. Packed 500-step windows
      # (the default since the twenty-sixth session; no_attn_early: after the wait)
      STEPS=500 VARIANTS="packed packed+no_attn_early packed packed+no_attn_early packed" bash $0 variants ;;
    x_traffic) # the small decode GEMMs re-read x [32, K] from L2 once per output tile: M / BLOCK_N of their
      # weight bytes (o_proj's 32-row tiles: 100%). Wider tiles with split-K (o_proj / down partials go to the
      # add + RMSNorm; QKV's last split program does the RoPE epilogue) cut that at the same program count;
      # deeper pipelines keep more bytes in flight. Timed in the tenth session (most of these, and
      # deeper ones): none beat the table, bench/results/README.md
      VARIANTS="base o=128,128,8,4,4 o=128,128,4,4,4 base o=64,128,4,5,2 o=256,64,8,3,8 base down=128,128,8,4,4
        down=256,64,8,3,8 base down=128,64,4,5,4 qkv=128,128,8,4,2 base qkv=64,128,4,5,2 qkv=128,128,4,4,4 base
        qkv=64,128,4,7 o=32,256,4,6 base lm_head=128,128,8,4 lm_head=256,64,8,3 base" bash $0 variants ;;
    chain) # what a launch boundary costs: 32 dependent o_proj-sized GEMMs as 32 PDL launches vs one persistent
      # kernel with a grid barrier between layers (bits compared first)
      timeout 240 python3 -m rollout.bench.chain --layers 32 --n 4096 --m 32 --out $OUT/chain_l8b_o.json 2>&1 \
        | grep -E "^NVIDIA|^[0-9]+,|Error" ;;
    weight_tiles) # the skinny GEMMs with each program's weight tiles packed into one contiguous run vs the plain
      # [N, K] layout (same bits), per linear at M = 32 and a layer's four back to back
      # (WT_M: row counts, e.g. "1 16 32": x is re-read from L2 by every program)
      m="${WT_M:-32}"; timeout 300 python3 -m rollout.bench.weight_tiles --shape llama3-8b --m $m \
        --out $OUT/weight_tiles_l8b_M${m// /_}.json 2>&1 | grep -E "^[a-z_]+ |Error|error" ;;
    gemm_ladder) # the packed GEMMs with one part taken away at a time (x loads, MMA) against pure reads of the
      # same bytes, at the GEMM's grid and at 4 programs per SM (LADDER_M: row counts)
      m="${LADDER_M:-32 16 1}"; timeout 300 python3 -m rollout.bench.gemm_ladder --shape llama3-8b --m $m \
        --out $OUT/gemm_ladder_l8b_M${m// /_}.json 2>&1 | grep -E "^[a-z_]+ |Error|error" ;;
    ws_chain) # the o_proj chain as one warp-specialized persistent kernel whose weight producer never waits for
      # data (Gluon), against PDL launches; bits compared first (WS_SLOTS: W_SLOTS,X_SLOTS,W_WARPS,X_WARPS,FLAGS,MMA)
      timeout 240 python3 -m rollout.bench.ws_chain --layers 32 --n 4096 --m 32 ${WS_SLOTS:+--slots $WS_SLOTS} \
        --out $OUT/ws_chain_l8b_o.json 2>&1 | grep -vE "^\s*$" | tail -12 ;;
    ws_mlp) # the 8B MLP's o_proj -> gate_up + SiLU -> down, 32 layers, as one warp-specialized persistent kernel
      # (Gluon) against skinny_gemm launches at its tile and at the table's configs, and launched once per layer;
      # without the norms, with the two residual add + RMSNorm as phases, and folded into the GEMMs; bits compared first
      # (WS_SLOTS: W_SLOTS,X_SLOTS,W_WARPS,X_WARPS)
      timeout 300 python3 -m rollout.bench.ws_mlp --layers 32 --m 32 ${WS_SLOTS:+--slots $WS_SLOTS} \
        --out $OUT/ws_mlp_l8b.json 2>&1 | grep -vE "^\s*$" | tail -18 ;;
    ws_layer) # what a decode megakernel could reach: all 32 layers' P1 bytes (QKV, K/V at P1's mean context, o_proj,
      # gate_up, down, two norms as phases or folded) in one warp-specialized persistent kernel, against the engine's
      # kernels as launches
      timeout 300 python3 -m rollout.bench.ws_layer --layers 32 --batch 32 --context ${WS_CONTEXT:-4352} \
        --out $OUT/ws_layer_l8b_B32_C${WS_CONTEXT:-4352}.json 2>&1 | grep -vE "^\s*$" | tail -8 ;;
    chain_order) # the chain above under both PDL orders, with tiles that fit 2-3 programs on an SM: does
      # wait-then-launch (ROLLOUT_PDL=1, one grid ahead) let the next GEMM's programs sit beside the running one?
      for mode in 2 1; do ROLLOUT_PDL=$mode timeout 200 python3 -m rollout.bench.chain --layers 32 --n 4096 --m 32 \
        --configs 32,256,4,5 32,256,4,3 32,128,4,6 32,128,4,4 64,128,4,3 --out $OUT/chain_l8b_o_pdl$mode.json 2>&1 \
        | grep -E "^NVIDIA|^[0-9]+,|Error" | sed "s/^/pdl$mode /"; done ;;
    read_pre) # what loads in flight across a kernel boundary save a pure stream: the attn_ceiling read kernel with
      # blocks loaded before its PDL wait (as a GEMM may load weights), at o_proj's and down's sizes, both PDL orders
      for mode in 2 1; do for c in 256 896; do ROLLOUT_PDL=$mode timeout 150 python3 -m rollout.bench.attn_ceiling \
        --batch 32 --context $c --layers 8 --configs 2,64,4,2 --pages shuffled --no-sdpa --read-grid 1 2 \
        --read-stages 2 --read-block 2048 4096 --read-pre 0 2 4 8 --out $OUT/attn_ceiling_read_pre_C${c}_pdl$mode.json \
        2>&1 | grep -E "^NVIDIA|read|Error" | sed "s/^/pdl$mode C$c /"; done; done
      # the same at 4 / 8 programs per SM, where the read kernel streams well (the fifteenth session's _wide_ files)
      for c in 256 896; do timeout 200 python3 -m rollout.bench.attn_ceiling --batch 32 --context $c --layers 8 \
        --configs 2,64,4,2 --pages shuffled --no-sdpa --read-grid 4 8 --read-stages 2 --read-block 1024 2048 \
        --read-pre 0 2 4 8 --out $OUT/attn_ceiling_read_pre_wide_C${c}_pdl2.json 2>&1 | grep -E "^NVIDIA|read|Error" \
        | sed "s/^/C$c /"; done ;;
    gattn) # decode attention's split kernel in Gluon (kernels/gluon_decode.py: a cp.async ring of K / V tiles), with one
      # split at two programs a SM (no merge kernel) and two at four: GPU tests, then the decode graphs at P1's context
      timeout 300 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_gluon_decode_cuda.py \
        > $OUT/gpu_tests_gluon_decode.log 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests_gluon_decode.log | tail -8
      timeout 420 python3 -m rollout.bench.step_variants --shape llama3-8b --batch 32 --context 4352 --steps 40 \
        --variants ${VARIANTS:-base gattn=32,6,1 gattn=32,5,1 base gattn=64,3,1 gattn=32,3 base} \
        --out $OUT/step_variants_gattn_l8b_B32_C4352.json 2>&1 | grep -A12 "^| variant" ;;
    p3_ab) # P3's step (Qwen2.5-1.5B, 512 rows, mean context 2304) under PDL off / wait-first / the old RoPE grid:
      # P3 read 73.6% at 4a16869 against 78.0% at 3901d6d, with 4.7% more GPU time; every GEMM there is cuBLAS
      timeout 300 python3 -m rollout.bench.step_variants --shape qwen2.5-1.5b --batch 512 --context 2304 --steps 40 \
        --variants base no_pdl base wait_first base rope_token base --out $OUT/step_variants_q15_B512_C2304.json \
        2>&1 | grep -A12 "^| variant" ;;
    repeat_base) # the baseline alone, 7 windows: does the last window (near the requests' end) read fast?
      VARIANTS="base base base base base base base" bash $0 variants ;;
    splitk_ab) # split-K partials into the norm, alternated with the baseline in one process, then P1 end to end
      # off and on (ROLLOUT_SPLITK_NORM)
      VARIANTS="base splitk_norm base splitk_norm base splitk_norm base" bash $0 variants
      TAG=_splitk0 ROLLOUT_SPLITK_NORM=0 bash $0 p1; TAG=_splitk1 ROLLOUT_SPLITK_NORM=1 bash $0 p1 ;;
    kernels)  timeout 240 python3 -m rollout.bench.kernels --out $OUT/kernels.json 2>&1 | tail -25 ;;
    sampler)  timeout 120 python3 -m rollout.bench.sampler --out $OUT/sampler.json 2>&1 | tail -15 ;;
    q05)      # issue 3's CPU-overhead-heavy workload, sync vs async, with a timeline
      timeout 300 $B --shape qwen2.5-0.5b --batch 64 --prompt-len 128 --gen-len 2048 --modes sync,async --hf none \
        --trace $OUT/timeline_q05 --out $OUT/q05_B64_G2048.json 2>&1 | grep -A12 "^roofline" ;;
    l8b_short) # 8B shape, short generations: sync vs async vs HF generate_batch; bf16 drift vs fp32
      timeout 400 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 1024 --modes sync,async \
        --hf generate_batch --hf-gen-len 256 --fp32-reference --out $OUT/l8b_B32_G1024.json 2>&1 | grep -E -A12 "^check|^roofline" ;;
    l8b_fp32) # the same weights in fp32: ours vs HF's fp32 forward (a logic error would show here)
      timeout 200 $B --shape llama3-8b --dtype float32 --batch 4 --prompt-len 128 --gen-len 32 --check-gen-len 32 \
        --modes async --hf none --out $OUT/l8b_fp32.json 2>&1 | grep "^check" ;;
    seed)     # issue 3 / issue 4 P1: the seed workload, sync vs async vs HF generate_batch
      timeout 590 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 8192 --modes sync,async --check-seqs 2 \
        --check-gen-len 64 --hf generate_batch --hf-gen-len 512 --trace $OUT/timeline_seed --out $OUT/seed_l8b_B32_G8192.json 2>&1 | grep -A12 "^roofline" ;;
    p1)       # issue 4 P1 alone (async): the seed workload with the current kernels (P1_ARGS: e.g. --pack-decode-weights)
      timeout 300 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 8192 --modes async --hf none ${P1_ARGS:-} \
        --out $OUT/p1_l8b_B32_G8192${TAG:-}.json 2>&1 | grep -A8 "^roofline" ;;
    p3)       timeout 400 $B --shape qwen2.5-1.5b --batch 64 --n 8 --prompt-len 256 --gen-len 4096 --modes async --hf none ${P3_ARGS:-} \
        --trace $OUT/timeline_p3 --out $OUT/p3_q15_64x8_G4096${TAG:-}.json 2>&1 | grep -A8 "^roofline"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['ours']; print(' '.join(f'{i}:{m:.2f}' \
        for i, m in d['step_ms_curve']), d['fraction_of_roofline'], d['runs_tok_s'], d['longest_steps_ms'][:4], \
        len(d['triton_compiles']), *d['triton_compiles'][:12], sep='\n')" $OUT/p3_q15_64x8_G4096${TAG:-}.json ;;
    p5)       timeout 400 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 16384 --modes async --hf none \
        --out $OUT/p5_l8b_B32_G16384.json 2>&1 | grep -A8 "^roofline" ;;
    drift)    timeout 240 python3 scripts/diag_bf16_drift.py --layers 32 --out $OUT/drift_l8b.json 2>&1 | tail -12 ;;
    pressure_ref0|pressure_ref1) # issue 7: the unpressured reference of B=64 x G=16384 as two engines of 32
      # (all 64 at once do not fit one H200); each chunk is also issue 4's P5 (8B, B=32, P=256, G=16384)
      c=${s#pressure_ref}; timeout 290 python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 \
        --gen-len 16384 --reference-chunks 2 --runs unpressured --chunk $c --reference-file $OUT/pressure_ref$c.npz \
        --out $OUT/pressure_ref${c}_l8b_B64_G16384.json > $OUT/pressure_ref$c.log 2>&1
      tr '\r' '\n' < $OUT/pressure_ref$c.log | grep -E "generate:|^reference" | tail -2 ;;
    pressured) # issue 7: KV for half of the B=64 x G=16384 demand, compared with the reference chunks
      timeout ${PRESSURED_TIMEOUT:-590} python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 --gen-len 16384 \
        --reference-chunks 2 --kv-fraction 0.5 --runs pressured --linear cublas --reference-file h200_ref/pressure_ref0.npz \
        h200_ref/pressure_ref1.npz --out $OUT/pressure_l8b_B64_G16384.json > $OUT/pressured.log 2>&1
      tr '\r' '\n' < $OUT/pressured.log | grep "generate:" | tail -1; tail -12 $OUT/pressured.log ;;
    pressured_swap) # issue 7: as `pressured`, preempting by swap to pinned host memory (needs h200_ref/)
      timeout ${PRESSURED_TIMEOUT:-590} python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 \
        --gen-len 16384 --reference-chunks 2 --kv-fraction 0.5 --runs pressured --preemption-mode swap --swap-space-gb 60 \
        --reference-file h200_ref/pressure_ref0.npz h200_ref/pressure_ref1.npz --out $OUT/pressure_swap_l8b_B64_G16384.json \
        > $OUT/pressured_swap.log 2>&1
      tr '\r' '\n' < $OUT/pressured_swap.log | grep "generate:" | tail -1; tail -8 $OUT/pressured_swap.log ;;
    tests_invariant) # batch-invariant mode: GEMM rows, engine bits vs batch-mates, bf16 pressure == unpressured
      timeout 400 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_batch_invariant_cuda.py \
        tests/gpu/test_skinny_gemm_cuda.py > $OUT/gpu_tests_invariant.log 2>&1
      grep -E "passed|failed|FAILED|Error|assert" $OUT/gpu_tests_invariant.log | tail -15 ;;
    p1_inv)   # P1 with batch_invariant=True: what bit-stable outputs cost against p1
      timeout 300 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 8192 --modes async --hf none \
        --batch-invariant --out $OUT/p1_l8b_B32_G8192_invariant.json 2>&1 | grep -A4 "^| run" ;;
    pressure_inv_ref0|pressure_inv_ref1) # issue 7 in bf16 with batch-invariant kernels: reference chunks
      c=${s#pressure_inv_ref}; timeout 560 python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 \
        --gen-len 16384 --reference-chunks 2 --runs unpressured --chunk $c --batch-invariant \
        --reference-file $OUT/pressure_inv_ref$c.npz --out $OUT/pressure_inv_ref${c}_l8b_B64_G16384.json > $OUT/pressure_inv_ref$c.log 2>&1
      tr '\r' '\n' < $OUT/pressure_inv_ref$c.log | grep -E "generate:|^reference" | tail -2 ;;
    pressured_inv) # issue 7: KV for half the demand, batch-invariant, bits compared with h200_ref/pressure_inv_ref{0,1}.npz
      timeout ${PRESSURED_TIMEOUT:-590} python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 \
        --gen-len 16384 --reference-chunks 2 --kv-fraction ${KV_FRACTION:-0.5} --runs pressured --batch-invariant \
        --reference-file h200_ref/pressure_inv_ref0.npz h200_ref/pressure_inv_ref1.npz \
        --out $OUT/pressure_inv_l8b_B64_G16384.json > $OUT/pressured_inv.log 2>&1
      tr '\r' '\n' < $OUT/pressured_inv.log | grep "generate:" | tail -1; tail -10 $OUT/pressured_inv.log ;;
    inv_refs_x2) # issue 7's two batch-invariant reference chunks at once on 2 GPUs (npz come back in $OUT;
      # the pressured_inv section reads them from h200_ref/ in a later call)
      for c in 0 1; do CUDA_VISIBLE_DEVICES=$c bash $0 pressure_inv_ref$c & done; wait ;;
    inv_x4)   # issue 7 on 4 GPUs in one call: reference chunks on GPUs 0 and 1 (then P5 and P1-invariant there),
      # pressured runs with KV for half and for three quarters of the demand on GPUs 2 and 3 (0.5 may not fit
      # in one call at the invariant kernels' speed; 0.75 is the one sure to). Logs in /tmp, tails printed.
      X="python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 --gen-len 16384 --reference-chunks 2 --batch-invariant"
      for c in 0 1; do (CUDA_VISIBLE_DEVICES=$c timeout 400 $X --runs unpressured --chunk $c \
        --reference-file /tmp/inv_ref$c.npz --out $OUT/pressure_inv_ref${c}_l8b_B64_G16384.json > /tmp/inv_ref$c.log 2>&1
        if [ $c = 0 ]; then CUDA_VISIBLE_DEVICES=0 timeout 260 $B --shape llama3-8b --batch 32 --prompt-len 256 \
          --gen-len 16384 --modes async --hf none --out $OUT/p5_l8b_B32_G16384.json > /tmp/p5.log 2>&1
        else CUDA_VISIBLE_DEVICES=1 timeout 170 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 8192 \
          --modes async --hf none --batch-invariant --out $OUT/p1_l8b_B32_G8192_invariant.json > /tmp/p1inv.log 2>&1; fi) & done
      for f in 0.5 0.75; do g=$([ $f = 0.5 ] && echo 2 || echo 3); CUDA_VISIBLE_DEVICES=$g timeout 585 $X --runs pressured \
        --kv-fraction $f --wait-reference-s 560 --reference-file /tmp/inv_ref0.npz /tmp/inv_ref1.npz \
        --out $OUT/pressure_inv_kv${f}_l8b_B64_G16384.json > /tmp/inv_pr$f.log 2>&1 & done
      wait; for f in /tmp/inv_ref0.log /tmp/inv_ref1.log /tmp/inv_pr0.5.log /tmp/inv_pr0.75.log; do echo "== $f"
        tr '\r' '\n' < $f | grep -vE "it/s\]$|s/it\]$" | tail -8; done
      for f in /tmp/p5.log /tmp/p1inv.log; do echo "== $f"; grep -A4 "^roofline" $f; done ;;
    tests_gemm) timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_skinny_gemm_cuda.py \
        tests/gpu/test_pipeline_cuda.py::test_gpu_busy_accounting_and_async_overlap > $OUT/gpu_tests_gemm.log 2>&1
      grep -E "passed|failed|FAILED|Error|assert" $OUT/gpu_tests_gemm.log | tail -15 ;;
    fleet_scaling)   # issue 9 (multi-GPU kinds): P3 per worker, 1 .. all GPUs. The device image has no Ray:
      # carry .whl (ray 2.60 cp312 without jars / dashboard build / rllib / serve / data / tune / train,
      # plus jsonschema and its needs) and pip install it --target /tmp/site first (see bench/results/README.md)
      timeout 420 python3 -m rollout.bench.fleet scaling --shape qwen2.5-1.5b --prompts-per-worker 64 --n 8 \
        --prompt-len 256 --gen-len 4096 --out $OUT/fleet_scaling_q15.json > $OUT/fleet_scaling.log 2>&1
      grep -E "^[0-9]+ worker|^\| |Error|error" $OUT/fleet_scaling.log | tail -14 ;;
    fleet_broadcast) # issue 9: 8B weights, trainer on GPU 0 -> workers on the others, over NCCL, during decode
      # KV for the 32 x 6.4K decode (27 GB) and room for the staged update; the default KV (85% of free) OOMed
      timeout 280 python3 -m rollout.bench.fleet broadcast --shape llama3-8b --batch 32 --gen-len 6144 \
        --update-after-s 15 --kv-bytes 40000000000 --out $OUT/fleet_broadcast_l8b.json > $OUT/fleet_broadcast.log 2>&1
      grep -E "^broadcast|Error|error" $OUT/fleet_broadcast.log | tail -8 ;;
    tests_new) # this session's GPU tests: PDL, the fused truncating sampler, the skinny GEMM in graphs
      timeout 300 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_pdl_cuda.py \
        tests/gpu/test_fused_sampler_cuda.py tests/gpu/test_skinny_gemm_cuda.py > $OUT/gpu_tests_new.log 2>&1
      grep -E "passed|failed|FAILED|Error|assert" $OUT/gpu_tests_new.log | tail -15 ;;
    p1_pdl)   # issue 4 P1 with programmatic dependent launch off, then on (two processes, same weights)
      for v in 0 1; do ROLLOUT_PDL=$v timeout 280 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 8192 \
        --modes async --hf none --out $OUT/p1_l8b_B32_G8192_pdl$v.json 2>&1 | grep -A4 "^| run"; done ;;
    p5_pdl)   ROLLOUT_PDL=1 timeout 400 $B --shape llama3-8b --batch 32 --prompt-len 256 --gen-len 16384 --modes async \
        --hf none --out $OUT/p5_l8b_B32_G16384_pdl1.json 2>&1 | grep -A8 "^roofline" ;;
    gemm_pdl) # split-K and PDL for the small-N decode GEMMs at M = 32 (gate_up / lm_head already fill the GPU)
      timeout 240 python3 -m rollout.bench.gemm --shape llama3-8b --m 32 --top 4 --pdl-top 4 --quick \
        --linears qkv o_proj down --out $OUT/gemm_l8b_pdl.json 2>&1 | tail -8 ;;
    tests_sampler) timeout 100 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_fused_sampler_cuda.py \
        > $OUT/gpu_tests_sampler.log 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests_sampler.log | tail -8 ;;
    sampler_trunc) timeout 150 python3 -m rollout.bench.sampler --rows 64 256 --num-splits 0 --dist flat peaked --row-splits 1 0 4 8 \
        --out $OUT/sampler_trunc.json 2>&1 | tail -40 ;;
    pressure_fp32_small) # as pressure_fp32 with G = 384 (fp32 8B decodes at ~700 tok/s: G = 2048 takes > 8 min)
      timeout 130 python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 --gen-len 384 \
        --dtype float32 --kv-fraction 0.5 --runs both --out $OUT/pressure_fp32_l8b_B64_G384.json > $OUT/pressure_fp32.log 2>&1
      tail -6 $OUT/pressure_fp32.log ;;
    pressure_fp32) # issue 7: greedy equality under KV pressure at the 8B shape, B = 64, in fp32 (argmax
      # decided by the math, not by bf16 rounding of a different batch composition); G = 2048 fits
      timeout 400 python3 -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 --gen-len 2048 \
        --dtype float32 --kv-fraction 0.5 --runs both --out $OUT/pressure_fp32_l8b_B64_G2048.json > $OUT/pressure_fp32.log 2>&1
      tail -8 $OUT/pressure_fp32.log ;;
    gemm)     timeout 200 python3 -m rollout.bench.gemm --shape llama3-8b --out $OUT/gemm_l8b.json 2>&1 | tail -30 ;;
    fused)    timeout 100 python3 -m rollout.bench.kernels --only fused --out $OUT/kernels_fused.json 2>&1 | tail -8 ;;
    weights)  timeout 300 python3 -m rollout.bench.weights --shape llama3-8b --batch 32 --gen-len 128 \
        --update-at-step 64 --out $OUT/weights_l8b.json 2>&1 | tail -5 ;;
  esac
  echo "[section $s: $(( $(date +%s) - t0 )) s]"
done
