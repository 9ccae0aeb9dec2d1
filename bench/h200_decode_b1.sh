#!/usr/bin/env bash
# The batch-1 decode round on the H200 (Llama-3.1-8B shape, dummy weights), in one device call:
# the kernel tests touched by decode fusions, bench/decode_roofline.py for bf16 / fp8 / int4
# weights (each against the roofline measured in its run), the CUDA-marked tests, then the
# per-kernel profile of a bf16 batch-1 step (bench/profile_step.py).
#   bash bench/h200_decode_b1.sh        # results in $OUT; SKIP="tests profile" etc.
#   QUANTS="none fp8 fp8:a8 fp8+head mxfp4" bash bench/h200_decode_b1.sh
# A QUANTS entry is a --quantization value, optionally with :G (fp8: --fp8-gemv G, int4:
# --int4-gemv G) and +head
# (--quantize-lm-head); the JSON is named after the entry (':' -> '-', '+' -> '-').
# The stages take about: tests 2 min, decode 20-40 s per format, profile 30 s.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-llama-3.1-8b}
TAG=${TAG:-b1}
SKIP=${SKIP:-}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
run() { [[ " $SKIP " == *" $1 "* ]] && return; shift; echo "== $*"; "$@"; }
# ~1 min; KERNEL_TESTS adds suites (tests/ops/test_gemv.py tests/ops/test_gemv_quant.py: ~4 min)
run kernels python3 -m pytest -q -p no:cacheprovider tests/ops/test_fused_rotary.py \
  tests/ops/test_paged_decode_triton.py tests/ops/test_kv_write_triton.py tests/ops/test_pdl.py \
  tests/ops/test_argmax.py ${KERNEL_TESTS:-} 2>&1 | tail -3
for q in ${QUANTS:-none fp8 int4}; do
  base=${q%%[:+]*}; qa=()
  [ "$base" != none ] && qa=(--quantization "$base")
  [[ $q == fp8:* ]] && { g=${q#*:}; qa+=(--fp8-gemv "${g%%+*}"); }
  [[ $q == int4:* ]] && { g=${q#*:}; qa+=(--int4-gemv "${g%%+*}"); }
  [[ $q == *+head* ]] && qa+=(--quantize-lm-head)
  name=${q//[:+]/-}
  run decode python3 bench/decode_roofline.py --model "$M" --prompt-len 512 --new-tokens 256 \
    "${qa[@]}" --out "$OUT/decode-roofline-h200-$M-w$name-$TAG.json" 2>&1 \
    | grep -E '"decode_tok_s"|fraction_of_roofline|"roofline_tok_s"'
done
run tests python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tail -3
run profile python3 bench/profile_step.py --model "$M" --batch 1 --steps 20 \
  --out "$OUT/profile-h200-$M-b1-kernels-wnone-$TAG.json" 2>&1 | grep -E "wall_ms|busy_frac"
