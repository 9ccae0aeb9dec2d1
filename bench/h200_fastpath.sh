#!/usr/bin/env bash
# The issue-3 figures for one model shape on the H200, in one device call (dummy bf16 weights):
# batch-1 decode against the bandwidth roofline (async scheduling on and off), the 64-sequence
# decode-step profile, 8k prefill against the matmul peak, one 200k-token prompt against the
# compute floor, and offline throughput on 1000 prompts of 1000 tokens with 1000 output tokens.
#   MODEL=llama-3.1-8b bash bench/h200_fastpath.sh      # results in $OUT
# Stages can be skipped: SKIP="offline long" etc. Carry the wheels in .whl (gguf is missing there).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-llama-3.1-8b}
SKIP=${SKIP:-}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
run() { [[ " $SKIP " == *" $1 "* ]] && return; shift; echo "== $*"; "$@"; }
run decode python3 bench/decode_roofline.py --model "$M" --prompt-len 512 --new-tokens 256 \
  --out "$OUT/decode-roofline-h200-$M.json" 2>&1 | grep -E "tok_s|fraction|TBps|\"o[nf]"
run offline python3 -m skyline.cli bench offline --model "$M" --load-format dummy \
  --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-seqs ${MAX_SEQS:-384} \
  --max-model-len 2048 --output "$OUT/offline-h200-$M-1000x1000.json" 2>&1 | tail -6
run profile python3 bench/profile_step.py --model "$M" --load-format dummy --batch 64 \
  --input-len 512 --out "$OUT/profile-h200-$M-b64.json" 2>&1 | tail -9
run prefill python3 bench/prefill_mfu.py --model "$M" --prompt-len 8192 \
  --out "$OUT/prefill-mfu-h200-$M.json" 2>&1 | grep -E "ttft|fraction|TFLOP"
run long python3 bench/long_prompt.py --model "$M" --prompt-len 200000 --chunk 8192 \
  --out "$OUT/long-prompt-h200-$M-200k.json" 2>&1 | grep -E "ttft|floor|peak|PFLOP"
