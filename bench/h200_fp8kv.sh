#!/usr/bin/env bash
# The fp8 KV cache (--kv-cache-dtype fp8) on the H200, in one device call (dummy bf16 weights):
# its CUDA tests, then each figure with the bf16 cache and the fp8 cache back to back: batch-1
# decode against the bandwidth roofline at a 512-token and a 32k-token context (where the KV
# read is 0.3 of the bytes per token), and offline throughput on 1000 prompts of 1000 tokens
# with 1000 output tokens (KV capacity sets how many sequences run at once).
#   MODEL=llama-3.1-8b bash bench/h200_fp8kv.sh      # results in $OUT
#   KVS=fp8 QUANT=fp8 SKIP="tests decode" bash bench/h200_fp8kv.sh   # fp8 weights and KV only
#   KVS=fp8 QUANT="none fp8" SKIP="tune decode" ...   # both weight formats, one after the other
#   WORDS="1 0" KVS=fp8 ...   # the fp8 cache read as int32 words (default) and as fp8 (0)
#   TUNE_ARGS="--batches 1 8 --kv-dtypes bf16 fp8" CTXS=512 ...   # other tuning / decode runs
#   BATCHED="8192 16384" SKIP="tests tune decode profile" ...   # offline at each token budget
# Stages can be skipped: SKIP="tests tune decode profile offline". The tune stage measures the
# fp8-KV decode kernel's launch configurations at the offline run's batch sizes first (table ->
# $OUT); the profile stage times one decode step of 256 sequences at a 1,000-token context.
# Carry the wheels in .whl (gguf is missing).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-llama-3.1-8b}
SKIP=${SKIP:-}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
skip() { [[ " $SKIP " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! skip tests; then
  python3 -m pytest -q -p no:cacheprovider tests/ops/test_kv_write_triton.py \
    tests/ops/test_kv_quant.py tests/ops/test_attention.py tests/ops/test_paged_decode_triton.py \
    tests/ops/test_paged_prefill_triton.py tests/engine/test_kv_cache_fp8.py \
    tests/ops/test_fp8_quant.py tests/quant/test_formats.py \
    2>&1 | tee "$OUT/pytest-cuda-fp8kv.log" | tail -5
fi
Q=${QUANT:-none}
if ! skip tune; then
  timeout 300 python3 bench/kernels/tune_attention.py --models "$M" \
    ${TUNE_ARGS:---batches 256 512 1024 --contexts 1000 2000 --kv-dtypes fp8 --no-prefill} \
    --budget-s ${TUNE_BUDGET:-60} --out "$OUT/attention-tune-fp8kv-h200-$M.json" 2>&1 | tail -40
  cp skyline/ops/configs/attention-h200.json "$OUT/" 2>/dev/null
fi
for kv in ${KVS:-auto fp8}; do
  if ! skip decode; then
    for ctx in ${CTXS:-512 32000}; do
      echo "== decode, kv $kv, context $ctx"
      python3 bench/decode_roofline.py --model "$M" --prompt-len $ctx --new-tokens 256 \
        --kv-cache-dtype $kv --out "$OUT/decode-roofline-h200-$M-ctx$ctx-kv$kv.json" 2>&1 \
        | grep -E "decode_tok_s\"|fraction|roofline_tok_s"
    done
  fi
  for words in ${WORDS:-1}; do
    export SKYLINE_KV_FP8_WORDS=$words
    tag=""; [ "$words" = 0 ] && tag=-fp8tiles
    for q in $Q; do
      if ! skip profile; then
        echo "== decode step, 256 x 1000 context, weights $q, kv $kv, words $words"
        python3 bench/profile_step.py --model "$M" --batch 256 --input-len 1000 --steps 10 \
          --quantization $q --kv-cache-dtype $kv \
          --out "$OUT/profile-h200-$M-b256-w$q-kv$kv$tag.json" 2>&1 | tail -3
      fi
      for mbt in ${BATCHED:-8192}; do
        skip offline && continue
        echo "== offline 1000 x (1000, 1000), weights $q, kv $kv, words $words, tokens/step $mbt"
        btag=""; [ "$mbt" != 8192 ] && btag=-mbt$mbt
        python3 -m skyline.cli bench offline --model "$M" --load-format dummy \
          --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-seqs 1024 \
          --max-model-len 2048 --kv-cache-dtype $kv --quantization $q \
          --max-num-batched-tokens $mbt \
          --output "$OUT/offline-h200-$M-1000x1000-w$q-kv$kv$tag$btag.json" 2>&1 | tail -5
      done
    done
  done
  unset SKYLINE_KV_FP8_WORDS
done
