#!/usr/bin/env bash
# The path a user types, measured on one GPU beside the benchmark of the same shape (issue 10: the user's
# `train --data X --size 1b` once ran at 14% GPU utilisation while `bench --size 1b` reported MFU 0.56).
# Usage: bash bench/user_path.sh OUT_DIR   (one GPU; the stdlib corpus; writes OUT_DIR/*.log and the runs)
set -uo pipefail
out=$1
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
summary() {  # what a run's summary and last metrics rows say
  python3 - "$1" <<'EOF'
import json, sys
run = sys.argv[1]
s = json.load(open(f"{run}/summary.json"))
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"tokens_per_s"' in l]
plan = json.load(open(f"{run}/run.json"))["plan"]
b = plan["batch"]
steady = rows[2:] or rows  # after compile and the first steps
tps = sum(r["tokens_per_s"] for r in steady) / len(steady)
mfu = [r["mfu"] for r in steady if r.get("mfu")]
util = [r["gpu/util_pct"] for r in steady if r.get("gpu/util_pct") is not None]
print(f"{run}: {plan['model']} {plan['params']:,} params, micro {b['micro_batch']} x {b['block_size']} x accum "
      f"{b['grad_accum']}; steady tokens/s {tps:,.0f}, MFU {sum(mfu) / max(1, len(mfu)):.3f}, GPU util "
      f"{sum(util) / max(1, len(util)):.0f}%; whole run {s['tokens_per_s']:,.0f} tok/s in {s['wall_s']:.0f} s")
EOF
}
# 1. exactly as a user types it (a step limit added): llama 1b and 125m on the Python standard library
python3 -m gptoughts train --data @stdlib --size 1b --max_steps 12 --log_interval 1 --out "$out/user-1b" \
  --no_progress > "$out/user-1b.log" 2>&1
grep -E "plan|corpus|batch:|steps:|memory|warning|done|error" "$out/user-1b.log" | head -20
summary "$out/user-1b" | tee -a "$out/summary.txt"
python3 -m gptoughts train --data @stdlib --size 125m --max_steps 30 --log_interval 5 --out "$out/user-125m" \
  --no_progress > "$out/user-125m.log" 2>&1
grep -E "plan|batch:|steps:|done|error" "$out/user-125m.log" | head -8
summary "$out/user-125m" | tee -a "$out/summary.txt"
# 2. the benchmark of the same shapes, same process type, synthetic tokens
python3 -m gptoughts bench --size 1b --block_size 2048 --batch_size 8 --steps 15 --warmup 5 2>&1 | tail -4 \
  | tee -a "$out/summary.txt"
