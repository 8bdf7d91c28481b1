#!/usr/bin/env bash
# The INL guide's hardware, emulated on one big GPU with --gpu_memory_gib (issue 36): the defaults plus the cap, a
# few steps each; each run's stdout (plan, the layout chosen, steps, summary) and metrics.jsonl land in OUT.
# Usage: bash bench/memory_caps.sh OUT [STEPS] [NAME...]   (grad_accum 1: a step of the default global batch would take
# minutes; NAMEs: only those runs). Each run's folder is removed after it: two 3b-4b checkpoints fill a 64 GiB disk.
set -uo pipefail
OUT=${1:?usage: bash bench/memory_caps.sh OUT [STEPS]}
STEPS=${2:-4}
mkdir -p "$OUT"
export GPTOUGHTS_CACHE=${GPTOUGHTS_CACHE:-/tmp/gptoughts-cache} PYTHONUNBUFFERED=1
common=(--data @stdlib --data.max_bytes 8000000 --max_steps "$STEPS" --grad_accum 1 --log_interval 1 --no_progress)
ONLY=("${@:3}")
run() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  if [ ${#ONLY[@]} -gt 0 ] && [[ ! " ${ONLY[*]} " == *" $name "* ]]; then return; fi
  echo "== $name: gptoughts train $* ${common[*]}"
  # the host's peak (offloaded states live there): the process's maximum resident set, from the kernel
  timeout "$limit" python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
print(f"host peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.1f} GiB")
sys.exit(rc)' gptoughts train "$@" "${common[@]}" --out "/tmp/runs/$name" >"$OUT/$name.log" 2>&1
  echo "exit $?"; cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
  grep -E "plan:|checkpointing|optimizer states|CPU offload|memory:|done|warning|error|host peak|Traceback" "$OUT/$name.log" | cut -c1-400
  rm -rf "/tmp/runs/$name"
}
run inl-3b-24gib 300 --model inl --size 3b --gpu_memory_gib 24
run inl-4b-40gib 420 --model inl --size 4b --gpu_memory_gib 40
run llama-3b-offload-16gib 300 --size 3b --parallel.cpu_offload true --gpu_memory_gib 16
