#!/usr/bin/env bash
# Scale-out on one multi-GPU host (issue 16, items 3-4), every run in one command on the same machine:
#   pp:  8b at seq 8192 on 2 GPUs: FSDP2 (batch 1 per GPU x accumulation 4) beside a 2-stage pipeline (1F1B,
#        4 rows per step in 4 micro-batches) - the same 8 x 8192 tokens per step, bf16, per-block compile;
#   tp:  the same 8b step with --parallel.tp 2 (one tensor-parallel group of 2);
#   dcp: 1b FSDP2 on 2 GPUs saving a sharded checkpoint (async) every 5 steps: the time training is blocked per
#        save (checkpoint_blocked_s; after the first, a save also waits for the previous one to be on disk, which
#        5 steps of 1b do not cover), then the step-10 checkpoint resumed on 1 GPU (DCP resharding).
# Usage: bash bench/scaleout.sh OUT_DIR "pp tp dcp"     writes OUT_DIR/scaleout.txt (runs in /tmp/scaleout)
set -uo pipefail
out=$1
what=${2:-"pp tp dcp"}
runs=/tmp/scaleout
mkdir -p "$out" "$runs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
summary() {  # mean tokens/s of the logged windows after the first two, peak memory, checkpoint blocking
  python3 - "$@" <<'PY'
import json, sys
run, label, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
except OSError:
    sys.exit(print(f"{label}: no metrics (failed; see its log)"))
steps = [r for r in rows if "tokens_per_s" in r]
used = steps[2:] or steps
tps = sum(r["tokens_per_s"] for r in used) / max(1, len(used))
mem = max((r.get("memory/peak_gib", 0) for r in used), default=0)
blocked = [round(r["checkpoint_blocked_s"], 2) for r in rows if "checkpoint_blocked_s" in r]
loss = [(r["step"], round(r["loss"], 4)) for r in steps][-1:]
print(f"{label}: {tps:,.0f} tokens/s total, {tps / gpus:,.0f} per GPU, peak {mem:.1f} GiB (rank 0), "
      f"{len(used)} windows, last loss {loss}" + (f", checkpoint blocked s {blocked}" if blocked else ""))
PY
}
common=(--data @stdlib --tokenizer bytes --no_progress --eval_interval 0 --train.sample_prompts= --warmup_steps 2
        --log_interval 2 --precision bf16 --compile true)
python3 -m gptoughts prepare --data @stdlib --tokenizer bytes --out /tmp/warm > /dev/null 2>&1
big=(--size 8b --block_size 8192 --max_steps 10 --train.checkpoints false "${common[@]}")
tr() { local n=$1 name=$2; shift 2
  torchrun --standalone --nproc_per_node="$n" -m gptoughts train "$@" --out "$runs/$name" > "$out/$name.log" 2>&1
}
for w in $what; do
  case $w in
    pp)
      tr 2 8b-fsdp2 "${big[@]}" --batch_size 1 --grad_accum 4 --parallel.strategy fsdp
      summary "$runs/8b-fsdp2" "8b fsdp x2 (b1 x accum 4 per GPU)" 2 | tee -a "$out/scaleout.txt"
      tr 2 8b-pp2 "${big[@]}" --batch_size 4 --grad_accum 2 --parallel.pp 2 --parallel.pp_microbatches 8
      summary "$runs/8b-pp2" "8b pp2 1f1b (8 rows in 8 micro-batches)" 2 | tee -a "$out/scaleout.txt" ;;
    tp)
      tr 2 8b-tp2 "${big[@]}" --batch_size 2 --grad_accum 4 --parallel.tp 2
      summary "$runs/8b-tp2" "8b tp2 (b2 x accum 4, both ranks the same rows)" 2 | tee -a "$out/scaleout.txt" ;;
    dcp)
      one=(--size 1b --block_size 2048 --batch_size 8 "${common[@]}" --save_interval 5)
      tr 2 1b-dcp "${one[@]}" --max_steps 20 --parallel.strategy fsdp
      summary "$runs/1b-dcp" "1b fsdp x2, async DCP save every 5 steps" 2 | tee -a "$out/scaleout.txt"
      du -sh "$runs/1b-dcp/checkpoints/step_000010" | tee -a "$out/scaleout.txt"
      cp -r "$runs/1b-dcp" "$runs/1b-dcp-one"
      rm -rf "$runs/1b-dcp-one/checkpoints/step_0000"{15,20}
      python3 -c "import json, sys; f = sys.argv[1]; rows = [l for l in open(f) if json.loads(l).get('step', 0) <= 10]; \
open(f, 'w').writelines(rows)" "$runs/1b-dcp-one/metrics.jsonl"
      # --resume auto: the run's own config (data, tokenizer), its newest checkpoint (step 10, the later ones removed)
      python3 -m gptoughts train --resume auto --out "$runs/1b-dcp-one" \
        --batch_size 8 --grad_accum 2 --log_interval 2 --no_progress > "$out/1b-dcp-one.log" 2>&1
      grep -E "resum|^error" "$out/1b-dcp-one.log" | head -3 | tee -a "$out/scaleout.txt"
      summary "$runs/1b-dcp-one" "1b from the 2-GPU step-10 checkpoint on 1 GPU" 1 | tee -a "$out/scaleout.txt"
      python3 -c "import json, sys; [print(f'{sys.argv[1][-10:]} loss at steps 12-20:', [(r['step'], round(r['loss'], 4)) \
for r in map(json.loads, open(sys.argv[1] + '/metrics.jsonl')) if 'loss' in r and r['step'] > 10]) for _ in [0]]" \
        "$runs/1b-dcp" | tee -a "$out/scaleout.txt"
      python3 -c "import json, sys; print('1 GPU resume loss at steps 12-20:', [(r['step'], round(r['loss'], 4)) \
for r in map(json.loads, open(sys.argv[1] + '/metrics.jsonl')) if 'loss' in r and r['step'] > 10])" \
        "$runs/1b-dcp-one" | tee -a "$out/scaleout.txt" ;;
  esac
done
grep -h -E "^error" "$out"/*.log | head -5
