#!/usr/bin/env bash
# The W4A8 GEMV round on the H200 in one device call: its tests, the tuning of its launch
# configurations for 1-8 rows (bench/kernels/tune_gemv_quant.py --kinds int4a8; the table lands in
# skyline/ops/configs/ and $OUT), then batch-1 decode of the Llama-3.1-8B shape with INT4 weights
# by the W4A8 GEMV (the default) and the weight-only one (bench/h200_decode_b1.sh), each against
# the roofline measured in its run.
#   TAG=chunks bash bench/h200_int4a8.sh      # results in $OUT; ROWS="1" BUDGET=120 to shorten
#   TESTS="tests/ops/test_fused_norm.py ..." adds test files; QUANTS="none int4" as in
#   h200_decode_b1.sh; TUNE=0 keeps the shipped table
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TAG=${TAG:-int4a8}
python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemv_int_a8.py ${TESTS:-} 2>&1 | tail -3
[ "${TUNE:-1}" = 1 ] && python3 bench/kernels/tune_gemv_quant.py --kinds int4a8 --rows ${ROWS:-1 2 4 8} \
  --budget-s ${BUDGET:-200} --report "$OUT/gemv-quant-tune-int4a8-$TAG-h200.json" 2>&1 \
  | grep -v "^ *$" | tail -40
SKIP="kernels tests profile" QUANTS=${QUANTS:-int4 int4:a16} TAG=$TAG bash bench/h200_decode_b1.sh
