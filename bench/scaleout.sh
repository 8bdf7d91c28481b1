#!/usr/bin/env bash
# Scale-out on one multi-GPU host (issue 16, items 3-4), every run in one command on the same machine:
#   pp:  8b at seq 8192 on 2 GPUs: FSDP2 (batch 1 per GPU x accumulation 4) beside a 2-stage pipeline (1F1B,
#        4 rows per step in 4 micro-batches) - the same 8 x 8192 tokens per step, bf16, per-block compile;
#   tp:  the same 8b step with --parallel.tp 2 (one tensor-parallel group of 2);
#   dcp: 1b FSDP2 on 2 GPUs saving a sharded checkpoint (async) every 5 steps: the time training is blocked per
#        save (checkpoint_blocked_s; after the first, a save also waits for the previous one to be on disk, which
#        5 steps of 1b do not cover), then the step-10 checkpoint resumed on 1 GPU (DCP resharding);
#   dcp-blocked: the time training is blocked per async sharded save (the copy of each rank's shards to the saver's
#        host buffers: pageable at the first save, pinned and reused after), with saves far enough apart that none
#        waits for the previous write (the summary says whether one did): 1b (seq 2048, batch 8 x accumulation 8
#        per GPU, a save every 10 of 30 steps) and 8b (seq 8192, batch 1 x accumulation 16 per GPU, a save every
#        6 of 12 steps), FSDP2 x GPUS. A watcher records when each checkpoint is complete and deletes it (two 8b
#        checkpoints, 78 GiB each, do not fit a 128 GiB disk). About 8 minutes on 2 H200s.
#   par: 8b at seq 8192 on GPUS GPUs, 4 x GPUS rows of 8192 tokens a step: FSDP2, tensor parallel over all GPUS,
#        a GPUS-stage pipeline, and tensor parallel 2 x FSDP2 GPUS/2 (EXTRA: more flags for all four, e.g. --fp8 true;
#        LAYOUTS: a subset of "fsdp tp pp tp2dp");
#   dcp-blocked-8b: dcp-blocked's 8b run alone on GPUS GPUs, accumulation 4, a save every 3 of 6 steps;
#   dcp-move: 1b FSDP2 on GPUS GPUs saving a sharded async checkpoint every 10 steps (blocked time per save), then
#        its step-10 checkpoint resumed on GPUS/2 GPUs and on 1 GPU (MOVE_TO: other counts, e.g. "2"): the next 10
#        steps' losses side by side;
#   agents: 1b DDP as two torchrun agents of GPUS/2 processes each on this host (c10d rendezvous, as two nodes
#        would run), beside one agent of GPUS processes: same losses, tokens/s.
# Usage: [GPUS=4] bash bench/scaleout.sh OUT_DIR "pp tp dcp dcp-blocked par dcp-move agents"
#   writes OUT_DIR/scaleout.txt (runs in /tmp/scaleout); GPUS (default 2) is the GPU count of the modes that take it
set -uo pipefail
out=$1
what=${2:-"pp tp dcp"}
gpus=${GPUS:-2}
read -r -a extra <<< "${EXTRA:-}"
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
watch_ckpt() {  # records each complete checkpoint under $1 (meta.json is written last) into $2, then deletes it
  python3 - "$1" "$2" <<'PY'
import json, os, shutil, sys, time
root, out = sys.argv[1], sys.argv[2]
seen = set()
while True:
    stop = os.path.exists(out + ".stop")  # one more pass after the run ended: its last checkpoint
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for n in names:
        meta = os.path.join(root, n, "meta.json")
        if n.startswith("step_") and n not in seen and os.path.exists(meta):
            seen.add(n)
            m = json.load(open(meta))
            gib = sum(f["bytes"] for f in m["files"].values()) / 2**30
            with open(out, "a") as f:
                f.write(json.dumps({"step": m["step"], "committed": os.path.getmtime(meta), "gib": gib}) + "\n")
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    if stop:
        break
    time.sleep(0.5)
PY
}
blocked_summary() {  # blocked seconds per save, whether the previous checkpoint was on disk before it began
  python3 - "$@" <<'PY'
import json, sys
run, done_log, label = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    done = {d["step"]: d for d in map(json.loads, open(done_log))}
except OSError:
    sys.exit(print(f"{label}: no metrics or no checkpoint (failed; see its log)"))
saves = [(r["step"], r["time"] - r["checkpoint_blocked_s"], r["checkpoint_blocked_s"]) for r in rows
         if "checkpoint_blocked_s" in r]
parts, prev = [], None
for step, start, blocked in saves:
    note = ""
    if prev is not None:
        p = done.get(prev)
        note = ", the previous one on disk before it" if p and p["committed"] <= start else ", WAITED for the previous"
    mine = done.get(step)
    disk = f", on disk {mine['committed'] - start:.0f} s after it began" if mine else ", never completed"
    parts.append(f"step {step}: blocked {blocked:.2f} s{note}{disk}")
    prev = step
gib = max((d["gib"] for d in done.values()), default=0)
print(f"{label} ({gib:.1f} GiB a checkpoint): " + "; ".join(parts))
PY
}
blocked_run() {  # NAME LABEL ARGS...: a 2-GPU FSDP run whose checkpoints are timed and deleted as they complete
  local name=$1 label=$2; shift 2
  rm -rf "$runs/$name" "$runs/$name.done"*
  watch_ckpt "$runs/$name/checkpoints" "$runs/$name.done" &
  local watcher=$!
  tr "$gpus" "$name" "$@" --parallel.strategy fsdp
  touch "$runs/$name.done.stop"
  wait "$watcher"
  blocked_summary "$runs/$name" "$runs/$name.done" "$label" | tee -a "$out/scaleout.txt"
}
# ONE and PREC replace the 1b shape and the precision of the dcp-move and agents modes (a CPU check of the script:
# ONE="--size debug --block_size 64 --batch_size 8" PREC="--device cpu --precision fp32 --compile false")
read -r -a one_shape <<< "${ONE:---size 1b --block_size 2048 --batch_size 8}"
read -r -a prec <<< "${PREC:---precision bf16 --compile true}"
common=(--data @stdlib --tokenizer bytes --no_progress --eval_interval 0 --train.sample_prompts= --warmup_steps 2
        --log_interval 2)
python3 -m gptoughts prepare --data @stdlib --tokenizer bytes --out /tmp/warm > /dev/null 2>&1
# BIG replaces the 8b shape and precision of the pp, tp and par modes (a CPU check: BIG="--size debug --block_size 64
# --device cpu --precision fp32 --compile false")
read -r -a big_shape <<< "${BIG:---size 8b --block_size 8192 --precision bf16 --compile true}"
big=("${big_shape[@]}" --max_steps 10 --train.checkpoints false "${common[@]}")
tr() { local n=$1 name=$2; shift 2  # RUN_TIMEOUT (s, default none) stops a run that hangs or crawls
  timeout "${RUN_TIMEOUT:-0}" torchrun --standalone --nproc_per_node="$n" -m gptoughts train "$@" \
    --out "$runs/$name" > "$out/$name.log" 2>&1
}
losses() {  # RUN FROM: the losses logged after step FROM
  python3 -c "import json, sys; print([(r['step'], round(r['loss'], 4)) for r in map(json.loads, \
open(sys.argv[1] + '/metrics.jsonl')) if 'loss' in r and r['step'] > int(sys.argv[2])])" "$1" "$2"
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
      one=(--size 1b --block_size 2048 --batch_size 8 "${common[@]}" --precision bf16 --compile true --save_interval 5)
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
    par)
      half=$((gpus / 2)); rows=$((4 * gpus)); tag=${EXTRA:+-x}
      for lay in ${LAYOUTS:-fsdp tp pp tp2dp}; do
        case $lay in
          fsdp) name=8b-fsdp$gpus$tag label="8b fsdp x$gpus ${EXTRA:-} (b1 x accum 4 per GPU)"
                args=(--batch_size 1 --grad_accum 4 --parallel.strategy fsdp) ;;
          tp) name=8b-tp$gpus$tag label="8b tp$gpus ${EXTRA:-} ($rows rows a step)"
              args=(--batch_size 4 --grad_accum $((rows / 4)) --parallel.tp "$gpus") ;;
          pp) name=8b-pp$gpus$tag label="8b pp$gpus 1f1b ${EXTRA:-} ($rows rows in $rows micro-batches)"
              args=(--batch_size "$rows" --grad_accum 1 --parallel.pp "$gpus" --parallel.pp_microbatches "$rows") ;;
          tp2dp) name=8b-tp2dp$half$tag label="8b tp2 x fsdp$half ${EXTRA:-} ($rows rows a step)"
                 args=(--batch_size 2 --grad_accum $((rows / 2 / half)) --parallel.tp 2 --parallel.strategy fsdp) ;;
        esac
        tr "$gpus" "$name" "${big[@]}" "${extra[@]}" "${args[@]}"
        summary "$runs/$name" "$label" "$gpus" | tee -a "$out/scaleout.txt"
        rm -rf "${runs:?}/$name"
      done ;;
    dcp-move)
      half=$((gpus / 2))
      one=("${one_shape[@]}" "${common[@]}" "${prec[@]}" --save_interval 10)
      tr "$gpus" 1b-move "${one[@]}" --max_steps 20 --parallel.strategy fsdp
      summary "$runs/1b-move" "1b fsdp x$gpus, async DCP save every 10 steps" "$gpus" | tee -a "$out/scaleout.txt"
      echo "  on $gpus GPUs, steps 11-20: $(losses "$runs/1b-move" 10)" | tee -a "$out/scaleout.txt"
      for n in ${MOVE_TO:-$half 1}; do
        rm -rf "$runs/1b-move$n" && cp -r "$runs/1b-move" "$runs/1b-move$n"
        rm -rf "$runs/1b-move$n/checkpoints/step_000020"
        python3 -c "import json, sys; f = sys.argv[1]; rows = [l for l in open(f) if json.loads(l).get('step', 0) <= 10]; \
open(f, 'w').writelines(rows)" "$runs/1b-move$n/metrics.jsonl"
        # the same rows a step: batch 8 x accumulation gpus/n on n GPUs
        launch=(python3 -m gptoughts); [[ $n -gt 1 ]] && launch=(torchrun --standalone --nproc_per_node="$n" -m gptoughts)
        "${launch[@]}" train --resume auto --out "$runs/1b-move$n" --batch_size 8 --grad_accum $((gpus / n)) \
          --log_interval 2 --no_progress > "$out/1b-move$n.log" 2>&1
        grep -E "^error" "$out/1b-move$n.log" | head -3 | tee -a "$out/scaleout.txt"
        echo "  resumed on $n GPU(s), steps 11-20: $(losses "$runs/1b-move$n" 10)" | tee -a "$out/scaleout.txt"
      done
      rm -rf "$runs"/1b-move* ;;
    agents)
      half=$((gpus / 2)); port=29611
      one=("${one_shape[@]}" --max_steps 20 --train.checkpoints false "${common[@]}" "${prec[@]}"
           --parallel.strategy ddp)
      tr "$gpus" 1b-agent1 "${one[@]}"
      summary "$runs/1b-agent1" "1b ddp, one agent of $gpus" "$gpus" | tee -a "$out/scaleout.txt"
      first=$(seq -s, 0 $((half - 1))); second=$(seq -s, "$half" $((gpus - 1)))
      for i in 0 1; do
        devs=$first; [[ $i == 1 ]] && devs=$second
        CUDA_VISIBLE_DEVICES=$devs torchrun --nnodes=2 --nproc_per_node="$half" --rdzv-backend=c10d \
          --rdzv-endpoint=127.0.0.1:$port --rdzv-id=agents --rdzv-conf=is_host=$((i == 0)) \
          -m gptoughts train "${one[@]}" --out "$runs/1b-agents2" > "$out/1b-agents2-$i.log" 2>&1 &
      done
      wait
      summary "$runs/1b-agents2" "1b ddp, two agents of $half (c10d)" "$gpus" | tee -a "$out/scaleout.txt"
      echo "  one agent:  $(losses "$runs/1b-agent1" 0)" | tee -a "$out/scaleout.txt"
      echo "  two agents: $(losses "$runs/1b-agents2" 0)" | tee -a "$out/scaleout.txt" ;;
    dcp-blocked)
      blocked_run 1b-blocked "1b fsdp x$gpus, async DCP save every 10 steps" --size 1b --block_size 2048 \
        --batch_size 8 --grad_accum 8 --max_steps 30 --save_interval 10 "${common[@]}" --precision bf16 --compile true
      blocked_run 8b-blocked "8b fsdp x$gpus, async DCP save every 6 steps" --size 8b --block_size 8192 \
        --batch_size 1 --grad_accum 16 --max_steps 12 --save_interval 6 "${common[@]}" --precision bf16 --compile true ;;
    dcp-blocked-8b)  # the 8b run alone, shorter: saves 3 steps apart (a step of 4 micro-batches)
      blocked_run 8b-blocked "8b fsdp x$gpus, async DCP save every 3 steps" --size 8b --block_size 8192 \
        --batch_size 1 --grad_accum 4 --max_steps 6 --save_interval 3 "${common[@]}" --precision bf16 --compile true ;;
  esac
done
grep -h -E "^error" "$out"/*.log | head -5
