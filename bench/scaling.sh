#!/usr/bin/env bash
# Multi-GPU scaling on one host (issue 16), every run in one command on the same machine:
#   1b (seq 2048, batch 8 per GPU, bf16, compile) on 1 GPU, then DDP and FSDP2 on every GPU of the machine;
#   8b at seq 8192, batch 1 per GPU, FSDP2 bf16;
#   8b-fp8: the same 8b runs in bf16, fp8 tensorwise, fp8 tensorwise with fp8 all-gather (needs torchao);
#   deepseek16b: the DeepSeek-V2-Lite shape under FSDP2, seq 4096, batch 1 per GPU, Muon, full activation
#   checkpointing (its AdamW state alone is ~250 GB), with the routed experts' loads.
#   1b-levers: the 1b runs of the first mode (1 GPU, DDP, FSDP2) beside FSDP2 with
#   --parallel.reshard_after_forward false and DDP with --parallel.ddp_bucket_mb 200 (issue 16's 97% target);
#   8b-levers: the 8b FSDP2 bf16 run beside the same with --parallel.reshard_after_forward false.
#   deepseek16b takes EXTRA (more flags, overriding the script's own: --parallel.ep 4, --log_interval 1),
#   STEPS (default 12) and RUN_TIMEOUT (seconds a run may take; default none).
# Usage: bash bench/scaling.sh OUT_DIR [1b|8b|both|8b-fp8|deepseek16b|1b-levers|8b-levers] [GPU COUNTS, e.g. "2 4"]
#   (default: both, every GPU)
#   writes OUT_DIR/scaling.txt and the runs' metrics
set -uo pipefail
out=$1
what=${2:-both}
counts=${3:-$(nvidia-smi -L | wc -l)}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
steady() {  # mean tokens/s of the logged windows after the first two (compile, warm-up), and the peak memory
  python3 - "$@" <<'EOF'
import json, sys
run, label, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"tokens_per_s"' in l]
rows = rows[2:] or rows
tps = sum(r["tokens_per_s"] for r in rows) / len(rows)
mem = max(r.get("memory/peak_gib", 0) for r in rows)
mfu = [r["mfu"] for r in rows if r.get("mfu")]
print(f"{label}: {tps:,.0f} tokens/s total, {tps / gpus:,.0f} per GPU, MFU {sum(mfu) / max(1, len(mfu)):.3f}, "
      f"peak {mem:.1f} GiB on rank 0 ({len(rows)} windows)")
EOF
}
with_extra() {  # NAME: the array NAME with the flags EXTRA also gives dropped, then EXTRA's (the CLI refuses a repeat)
  local -n base=$1
  local -a add names=() kept=()
  read -r -a add <<< "${EXTRA:-}"
  for a in "${add[@]}"; do [[ $a == --* ]] && names+=("${a%%=*}"); done
  local i=0 n=${#base[@]}
  while (( i < n )); do
    local f=${base[i]} take=1
    [[ $f == --* && $f != *=* && $((i + 1)) -lt $n && ${base[i + 1]} != --* ]] && take=2
    if [[ " ${names[*]} " != *" ${f%%=*} "* ]]; then kept+=("${base[@]:i:take}"); fi
    i=$((i + take))
  done
  base=("${kept[@]}" "${add[@]}")
}
common=(--data @stdlib --tokenizer bytes --no_progress --eval_interval 0 --train.checkpoints false
        --train.sample_prompts= --warmup_steps 5 --log_interval 5 --precision bf16 --compile true)
python3 -m gptoughts prepare --data @stdlib --tokenizer bytes --out /tmp/warm > /dev/null 2>&1
if [[ $what == 1b || $what == both ]]; then
  one=(--size 1b --block_size 2048 --batch_size 8 --max_steps 25 "${common[@]}")
  python3 -m gptoughts train "${one[@]}" --out "$out/1b-1gpu" > "$out/1b-1gpu.log" 2>&1
  steady "$out/1b-1gpu" "1b 1 GPU" 1 | tee -a "$out/scaling.txt"
  for n in $counts; do
    for s in ddp fsdp; do
      torchrun --standalone --nproc_per_node="$n" -m gptoughts train "${one[@]}" --parallel.strategy $s \
        --out "$out/1b-$s$n" > "$out/1b-$s$n.log" 2>&1
      steady "$out/1b-$s$n" "1b $s x$n" "$n" | tee -a "$out/scaling.txt"
    done
  done
fi
if [[ $what == 1b-levers ]]; then
  one=(--size 1b --block_size 2048 --batch_size 8 --max_steps 25 "${common[@]}")
  python3 -m gptoughts train "${one[@]}" --out "$out/1b-1gpu" > "$out/1b-1gpu.log" 2>&1
  steady "$out/1b-1gpu" "1b 1 GPU" 1 | tee -a "$out/scaling.txt"
  for n in $counts; do
    for v in fsdp fsdp-keep ddp ddp-200mb; do
      extra=(--parallel.strategy "${v%%-*}")
      [[ $v == fsdp-keep ]] && extra+=(--parallel.reshard_after_forward false)
      [[ $v == ddp-200mb ]] && extra+=(--parallel.ddp_bucket_mb 200)
      torchrun --standalone --nproc_per_node="$n" -m gptoughts train "${one[@]}" "${extra[@]}" \
        --out "$out/1b-$v$n" > "$out/1b-$v$n.log" 2>&1
      steady "$out/1b-$v$n" "1b $v x$n" "$n" | tee -a "$out/scaling.txt"
    done
  done
fi
if [[ $what == 8b || $what == both ]]; then
  big=(--size 8b --block_size 8192 --batch_size 1 --max_steps 20 "${common[@]}")
  for n in $counts; do
    torchrun --standalone --nproc_per_node="$n" -m gptoughts train "${big[@]}" --parallel.strategy fsdp \
      --out "$out/8b-fsdp$n" > "$out/8b-fsdp$n.log" 2>&1
    steady "$out/8b-fsdp$n" "8b seq 8192 fsdp bf16 x$n" "$n" | tee -a "$out/scaling.txt"
  done
fi
if [[ $what == 8b-levers ]]; then
  big=(--size 8b --block_size 8192 --batch_size 1 --max_steps 20 "${common[@]}")
  for n in $counts; do
    for v in fsdp fsdp-keep; do
      extra=()
      [[ $v == fsdp-keep ]] && extra=(--parallel.reshard_after_forward false)
      torchrun --standalone --nproc_per_node="$n" -m gptoughts train "${big[@]}" "${extra[@]}" \
        --parallel.strategy fsdp --out "$out/8b-$v$n" > "$out/8b-$v$n.log" 2>&1
      steady "$out/8b-$v$n" "8b seq 8192 $v bf16 x$n" "$n" | tee -a "$out/scaling.txt"
    done
  done
fi
if [[ $what == 8b-fp8 ]]; then
  big=(--size 8b --block_size 8192 --batch_size 1 --max_steps 15 "${common[@]}")
  for n in $counts; do
    for v in bf16 fp8 fp8ag; do
      extra=()
      [[ $v == fp8* ]] && extra=(--fp8 true --fp8_recipe tensorwise)
      [[ $v == fp8ag ]] && extra+=(--perf.fp8_all_gather true)
      torchrun --standalone --nproc_per_node="$n" -m gptoughts train "${big[@]}" "${extra[@]}" \
        --parallel.strategy fsdp --out "$out/8b-$v$n" > "$out/8b-$v$n.log" 2>&1
      steady "$out/8b-$v$n" "8b seq 8192 fsdp $v x$n" "$n" | tee -a "$out/scaling.txt"
    done
  done
fi
if [[ $what == deepseek16b ]]; then
  ds=(--model deepseek --size 16b --block_size 4096 --batch_size 1 --max_steps "${STEPS:-12}" --optimizer muon
      --activation_checkpointing full "${common[@]}")
  with_extra ds  # EXTRA may override any of them (--log_interval 1, --batch_size 2, ...)
  for n in $counts; do
    timeout "${RUN_TIMEOUT:-0}" torchrun --standalone --nproc_per_node="$n" -m gptoughts train "${ds[@]}" --parallel.strategy fsdp \
      --out "$out/ds16-fsdp$n" > "$out/ds16-fsdp$n.log" 2>&1
    steady "$out/ds16-fsdp$n" "deepseek 16b seq 4096 fsdp muon x$n ${EXTRA:-}" "$n" | tee -a "$out/scaling.txt"
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if 'moe/load_cv' in l][-1]; \
print('  expert loads at step', r['step'], {k: round(r[k], 3) for k in r if k[4:] in ('load_max', 'load_min', \
'load_cv', 'maxvio')})" "$out/ds16-fsdp$n/metrics.jsonl" | tee -a "$out/scaling.txt"
  done
fi
grep -h -E "^error|Error" "$out"/*.log | head -5
