#!/usr/bin/env bash
# The efficient frontier of the Llama-3.1-8B shape on one H200, in one device call (dummy bf16
# weights, ~7 min): `skyline frontier` over weight quantization {none, fp8} x KV cache {bf16,
# fp8}, each setting one `skyline serve` (256 sequences) driven at 1, 32 and 256 concurrent
# users with random 512-token prompts and 256 output tokens (EOS ignored), 15 s per level.
#   bash bench/h200_frontier.sh                    # results in $OUT/frontier-h200-llama-3.1-8b
#   MODEL=qwen3-8b LEVELS=1,64 DURATION=20 bash bench/h200_frontier.sh
# The model folder gets a synthetic word-level tokenizer (bench/dummy_tokenizer.py) so the
# server streams text and detokenizes like a real one, and the load generator sees each token.
# Quality (KL / top-1 vs unquantized) is recorded as not applicable: random weights say nothing
# about a trained model's. BUDGET_S caps the sweep; a cut sweep still reports its finished points.
# Carry the wheels in .whl (fastapi, uvicorn, pyzmq, aiohttp, ... are missing on the device).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-llama-3.1-8b}
LEVELS=${LEVELS:-1,32,256}
DURATION=${DURATION:-15}
BUDGET_S=${BUDGET_S:-480}
WORK=/tmp/frontier-h200            # frontier.json, per-point JSON and server logs
RES=$OUT/frontier-h200-$M          # what bench/results keeps: JSON, PNG, HTML, runs.json
# (the device hands back 8 files per call: the per-point JSON travel as one runs.json)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
MDIR=/tmp/$M-dummy
python3 bench/dummy_tokenizer.py --model "$M" --out "$MDIR" || exit 1
BASE="--model $MDIR --load-format dummy --max-model-len 2048 --max-num-seqs 256"
BASE="$BASE --gpu-memory-utilization 0.9 --shutdown-timeout 5"
CMD=(python3 -m skyline.cli frontier --base-flags "$BASE"
     --grid quantization=none,fp8 --grid kv_cache_dtype=auto,fp8
     --concurrency "$LEVELS" --workload random --input-len 512 --output-len 256
     --duration "$DURATION" --goodput ttft:1000 tpot:50 --startup-timeout 180
     --output-dir "$WORK")
"${CMD[@]}" --dry-run
timeout -s TERM "$BUDGET_S" "${CMD[@]}"
echo "frontier exit code $?"
# Date, command and machine into the JSON; the report again (a cut sweep wrote none).
python3 - "$WORK" "$RES" "${CMD[*]}" <<'EOF'
import datetime, json, os, shutil, sys

import torch

from skyline.bench.offline import machine_info
from skyline.bench.report import write_report

work, res, cmd = sys.argv[1:]
path = os.path.join(work, "frontier.json")
with open(path) as f:
    state = json.load(f)
state["run"] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": "bash bench/h200_frontier.sh: " + cmd,
                "machine": machine_info("cuda" if torch.cuda.is_available() else "cpu")}
with open(path, "w") as f:
    json.dump(state, f, indent=1)
write_report(state, work)
os.makedirs(res, exist_ok=True)
for name in os.listdir(work):
    if name.endswith((".json", ".png", ".html")):
        shutil.copy(os.path.join(work, name), res)
runs = {}
for name in sorted(os.listdir(os.path.join(work, "runs"))):
    if name.endswith(".json"):
        with open(os.path.join(work, "runs", name)) as f:
            runs[name] = json.load(f)
with open(os.path.join(res, "runs.json"), "w") as f:
    json.dump(runs, f, indent=1)
print("results in", res)
EOF
