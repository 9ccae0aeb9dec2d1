#!/usr/bin/env bash
# FP8 batch-1 decode on the H200 with the fp8 x fp8 tensor-core GEMV (W8A8 at <= 8 rows), in
# one device call: the CUDA tests of the fp8 GEMVs, tuning of the "gemv_fp8a8" and
# "gemv_fp8a8q" tables (rows 1 and 2; merged into skyline/ops/configs/gemv-quant-h200.json,
# copied to $OUT), then bench/decode_roofline.py on Llama-3.1-8B dummy weights: bf16, and fp8
# with the weight-only GEMV (w8a16), with x quantized per row by its own kernel (a8q) and with
# x quantized inside the GEMV (a8), each against the roofline measured in its run.
#   bash bench/h200_fp8_gemv.sh        # results in $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SKIP=${SKIP:-}
run() { [[ " $SKIP " == *" $1 "* ]] && return; shift; echo "== $*"; "$@"; }
run test python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemv_quant.py \
  -k "${TESTK:-a8 or linear_methods or default_configs_on_model or fp8}" 2>&1 | tail -3
run tune python3 bench/kernels/tune_gemv_quant.py --kinds fp8a8 fp8a8q --rows 1 2 --budget-s ${BUDGET:-150} \
  --report "$OUT/gemv-quant-tune-fp8a8-h200.json" 2>&1 | grep -v "^ *$" | tail -14
for v in bf16 w8a16 a8q a8; do
  q=(--quantization fp8 --fp8-gemv $v); [ $v = bf16 ] && q=()
  run decode python3 bench/decode_roofline.py --model llama-3.1-8b "${q[@]}" \
    --out "$OUT/decode-roofline-h200-llama-3.1-8b-fp8gemv-$v.json" 2>&1 \
    | grep -E '"decode_tok_s"|fraction_of_roofline|"roofline_tok_s"'
done
