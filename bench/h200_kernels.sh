#!/usr/bin/env bash
# The kernel round on the H200 (Llama-3.1-8B shape, dummy bf16 weights), as two device calls
# back to back (tuned tables are kept in /root/cfg between them):
#   STAGE=tune bash bench/h200_kernels.sh   # CUDA tests of the attention and quantized GEMV
#                                            # kernels, then bench/kernels/tune_attention.py and
#                                            # bench/kernels/tune_gemv_quant.py (tables -> $OUT)
#   STAGE=measure bash bench/h200_kernels.sh # with those tables: batch-1 decode bf16 / fp8 /
#                                            # int4 against the roofline, offline 1000x1000
# Narrower rounds: TESTK (pytest -k), KINDS (GEMV kinds tuned), QUANTS (weights measured),
# SKIP (stages left out: tests attn gemv decode offline).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /root/cfg
M=${MODEL:-llama-3.1-8b}
SKIP=${SKIP:-}
skip() { [[ " $SKIP " == *" $1 "* ]]; }
if ls .whl/*.whl >/dev/null 2>&1; then  # gguf (tests/ops imports it)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
skip tests || timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops \
  -k "${TESTK:-attention or paged or gemv_quant}" 2>&1 | tee "$OUT/pytest-cuda-kernels.log" | tail -4
if [ "${STAGE:-tune}" = tune ]; then
  skip attn || timeout 200 python3 bench/kernels/tune_attention.py --budget-s ${ATTN_BUDGET:-110} \
    --out "$OUT/attention-tune-h200.json" 2>&1 | tail -30
  skip gemv || timeout 170 python3 bench/kernels/tune_gemv_quant.py --rows 1 2 --kinds ${KINDS:-int4 fp8} \
    --budget-s ${GEMV_BUDGET:-100} --report "$OUT/gemv-quant-tune-h200.json" 2>&1 | tail -20
  cp skyline/ops/configs/attention-h200.json skyline/ops/configs/gemv-quant-h200.json \
    "$OUT/" 2>/dev/null
  cp "$OUT"/attention-h200.json "$OUT"/gemv-quant-h200.json /root/cfg/ 2>/dev/null
else
  cp /root/cfg/*.json skyline/ops/configs/ 2>/dev/null; ls skyline/ops/configs
  if ! skip decode; then
    for q in ${QUANTS:-none fp8 int4}; do
      echo "== decode b1, weights $q"
      qa=(); [ $q != none ] && qa=(--quantization $q)
      timeout 150 python3 bench/decode_roofline.py --model "$M" --prompt-len 512 \
        --new-tokens 256 "${qa[@]}" --out "$OUT/decode-roofline-h200-$M-w$q.json" 2>&1 \
        | grep -E "decode_tok_s\"|fraction|roofline_tok_s"
    done
  fi
  skip offline || timeout 260 python3 -m skyline.cli bench offline --model "$M" \
    --load-format dummy --num-prompts 1000 --input-len 1000 --output-len 1000 \
    --max-num-seqs ${MAX_SEQS:-512} --max-model-len 2048 \
    --output "$OUT/offline-h200-$M-1000x1000.json" 2>&1 | tail -4
fi
