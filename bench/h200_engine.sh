#!/usr/bin/env bash
# One device call on the H200: CUDA tests, then offline throughput of skyline vs HF transformers,
# the decode-step profile, batch-1 decode vs the bandwidth roofline and 8k prefill vs the matmul
# peak, on dummy weights (bf16). Results land in $OUT.
#   bash bench/h200_engine.sh                          # Llama-3.1-8B shape, with the CUDA tests
#   MODEL=qwen3-8b TESTS=0 bash bench/h200_engine.sh   # another shipped config, no tests
# Carry the gguf wheel in .whl (the device image lacks it).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-llama-3.1-8b}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py tests/ops \
    tests/model/test_hf_parity.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -5
fi
python3 bench/offline_vs_hf.py --model "$M" --load-format dummy --device cuda \
  --num-prompts ${NUM_PROMPTS:-64} --input-len 512 --output-len 128 \
  --out "$OUT/offline-h200-$M-dummy.json" 2>&1 | tail -8
python3 bench/profile_step.py --model "$M" --load-format dummy --batch 64 --input-len 512 \
  --out "$OUT/profile-h200-$M-b64.json" 2>&1 | tail -12
python3 bench/decode_roofline.py --model "$M" --prompt-len 512 --new-tokens 256 \
  --out "$OUT/decode-roofline-h200-$M.json" 2>&1 | grep -E "tok_s|fraction|TBps"
python3 bench/prefill_mfu.py --model "$M" --prompt-len 8192 \
  --out "$OUT/prefill-mfu-h200-$M.json" 2>&1 | grep -E "ttft|fraction|TFLOP"
