#!/usr/bin/env bash
# Host work per step at 1,000 requests on the H200 machine, and what it costs the offline run.
# Stages (STAGES, in order): host = bench/host_overhead.py on this machine's CPU (the engine's
# Python per decode step, no model); offline = 1000 prompts x (1000 in, 1000 out) for each
# weights/KV pair in PAIRS (dummy Llama-3.1-8B weights), against the floor of the matmul peak
# and copy bandwidth measured first (--floor); profile = one decode step of 1,000
# sequences at a 1,500-token context, GPU kernels against wall time; small = the same profile
# for 64 sequences at a 512-token context and for one sequence (bf16 weights and cache: the
# targets table's "decode step" rows).
#   STAGES="host offline" PAIRS="fp8/fp8 none/fp8" bash bench/h200_host.sh   # results in $OUT
#   STAGES=profile PROFILE_PAIR=fp8/fp8 bash bench/h200_host.sh
# Carry the wheels in .whl (gguf is missing).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-llama-3.1-8b}
TAG=${TAG:-}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for stage in ${STAGES:-host offline profile small}; do
  case $stage in
    host)
      echo "== host work per decode step (no model), this machine's CPU"
      CUDA_VISIBLE_DEVICES= python3 bench/host_overhead.py --batch 256 1024 --context 1500 \
        --steps 60 --out "$OUT/host-overhead-h200-ctx1500$TAG.json" 2>&1 | grep -E "^batch|wrote"
      ;;
    offline)
      for pair in ${PAIRS:-fp8/fp8 none/fp8 none/auto}; do
        q=${pair%/*}; kv=${pair#*/}
        echo "== offline 1000 x (1000, 1000), weights $q, kv $kv"
        python3 -m skyline.cli bench offline --model "$M" --load-format dummy \
          --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-seqs 1024 \
          --max-model-len 2048 --kv-cache-dtype $kv --quantization $q --floor \
          --output "$OUT/offline-h200-$M-1000x1000-w$q-kv$kv$TAG.json" 2>&1 | tail -13
      done
      ;;
    profile)
      pair=${PROFILE_PAIR:-fp8/fp8}; q=${pair%/*}; kv=${pair#*/}
      echo "== decode step, 1000 x 1500 context, weights $q, kv $kv"
      python3 bench/profile_step.py --model "$M" --batch 1000 --input-len 1500 --steps 10 \
        --quantization $q --kv-cache-dtype $kv --max-num-seqs 1024 \
        --out "$OUT/profile-h200-$M-b1000-ctx1500-w$q-kv$kv$TAG.json" 2>&1 | tail -25
      ;;
    small)
      for b in 64 1; do
        echo "== decode step, $b x 512 context, bf16"
        python3 bench/profile_step.py --model "$M" --batch $b --input-len 512 --steps 20 \
          --out "$OUT/profile-h200-$M-b$b$TAG.json" 2>&1 | tail -12
      done
      ;;
  esac
done
