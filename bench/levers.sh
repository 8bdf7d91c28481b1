#!/usr/bin/env bash
# Speed levers of issues 13 and 14 on one GPU, side by side in one command per part.
# Usage: bash bench/levers.sh OUT_DIR PART    PART = startup | bench | modes | user125 | kernels | parity
#                                                   | ttl | ttl-fresh | ttl-warm | inductor | pool
#   startup: the same 1b command run twice (cold: data + compile; warm: every cache), at batch 8 and as a user
#            types it; prints each run's "first step done ... after the command" line (summary.json: startup).
#   bench:   1b b8 ours vs transformers (eager, compiled); Muon vs AdamW step time at 1b and 125m; the 47M
#            small shape (d 512, 12 layers, seq 512, batch 32) with per-block compile, whole-model compile and
#            CUDA graphs, beside compiled transformers. One JSON line per config in OUT_DIR/bench.jsonl.
#   kernels: attention backends (tests on the GPU, bench/attention.py) and the 1b b8 step with each lever of issue
#            13 items 2 and 4 (FA4 attention, bf16 / 8-bit AdamW moments), side by side. FA4 and torchao are not on
#            the GPU machines: install their wheels first (pip install --no-deps --target /tmp/site ...) and put
#            /tmp/site and /tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH.
#   parity:  300 steps of 350m on real shards with fp32, bf16 and 8-bit AdamW moments (same seed and data order;
#            bench/fp8_vs_bf16_loss.sh), then the start-up of a second identical 1b run under cProfile.
#   ttl:     issue 14's wall time: where the imports go (python -X importtime, twice), 125m compiled vs eager
#            steps, then bench/time_to_loss.py (adamw, speedrun, speedrun eager, hf) on the transformers source,
#            10M tokens; results, logs and each run's metrics.jsonl in OUT_DIR/ttl. ttl-fresh: only the latter.
#   ttl-warm: the speedrun variant run twice with the usual compile caches (the second is a user's second run of
#            the same config), then a fresh-cache speedrun start-up (13 steps, one evaluation) under cProfile.
#   inductor: inductor settings that may cut compile time or launch gaps, each from an empty compile cache: the
#            default, TORCHINDUCTOR_MIX_ORDER_REDUCTION=0, TORCHINDUCTOR_ENABLE_PDL=1 (Hopper's programmatic
#            dependent launch), at 125m and at the 47M small shape; each row's wall time includes its compile.
#   pool:    start-up of the speedrun config (13 steps, one evaluation) from an empty compile cache, with the
#            compile workers started before the data and model steps and at the first graph (torch's), twice each,
#            alternating (needs gptoughts.training.build.start_compile_workers, of commit df10059: no gain measured,
#            removed since), then an eager start-up of the same config under cProfile.
#   small:   small models on the user's path (train with auto batch, evaluations, samples): per-block compile ("old",
#            the default before session 10), auto (a 40-step run is too short for the whole model: per-block), the
#            whole model, and the whole model with CUDA graphs, at 125m, the 47M shape (block 512), 350m and gpt2
#            small; each run's plan, first-step line, steady tokens/s of windows without an evaluation and done line in
#            OUT_DIR/small.txt (SHAPES, VARIANTS: subsets).
#   lora:    bench/finetune_vs_peft.py at 1b, seq 2048, batch 4, dropout 0 and 0.05 (LORA_DROPOUTS: a subset; FA4 where
#            installed); LORA_VARIANTS: its --variants (JSON list of config overrides for ours, each timed as a row).
#   checkpoints: `train --size 1b` on the stdlib (4 steps, an evaluation every 2, so three checkpoints of 13 GB) with
#            checkpoints written in the background (the default on GPUs) and synchronously; each run's whole time,
#            the seconds each save stopped training (metrics.jsonl: checkpoint_blocked_s) and its tokens/s windows
#            in OUT_DIR/checkpoints.txt, then a resume of the background run (its checkpoint loads).
#   ce-wgrad: the chunked loss's head weight gradient accumulated in the matmul vs a bf16 product cast and added,
#            side by side at 125m (b128, seq 1024) and 1b (b8, seq 2048), twice each (python3 bench/ce_wgrad.py).
#   fp8:     3b, seq 2048, batch 4: bf16, fp8 tensorwise and fp8 with fast accumulation in the backward matmuls too,
#            twice each, side by side (bench/gpu_matrix.py --only 3b-fp8-levers, OUT_DIR/fp8.jsonl); then, unless
#            PARITY=0, 300 steps of each on real shards (bench/fp8_vs_bf16_loss.sh, OUT_DIR/parity).
set -uo pipefail
out=$1 part=$2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
G="python3 -m gptoughts"
if [ "$part" = startup ]; then
  for run in cold warm; do
    $G train --data @stdlib --size 1b --batch_size 8 --grad_accum 1 --max_steps 2 --eval_interval 0 \
      --no_progress --out "/tmp/su-b8-$run" > "$out/startup-b8-$run.log" 2>&1
    echo "b8 $run: $(grep -E 'first step done|error' "$out/startup-b8-$run.log")" | tee -a "$out/startup.txt"
  done
  for run in cold warm; do
    $G train --data @stdlib --size 1b --max_steps 1 --no_progress --out "/tmp/su-user-$run" \
      > "$out/startup-user-$run.log" 2>&1
    echo "user $run: $(grep -E 'batch:|first step done|error' "$out/startup-user-$run.log" | tr '\n' ' ')" \
      | tee -a "$out/startup.txt"
  done
fi
B="$G bench --json --steps 12 --warmup 5"
mkdir -p /tmp/levers-err
cat > /tmp/levers-err/row.py <<'PY'
import json, sys
r = json.loads(sys.argv[1])
hf = r.get("hf", {})
extra = "  ".join(
    f"hf {m} {v['tokens_per_s']:,.0f} ({v['step_ms']:.1f} ms, ours {v['speedup']:.2f}x)" for m, v in hf.items()
)
print(
    f"{r['name']:22s} {r['params'] / 1e6:7.1f}M  {r['tokens_per_s']:>10,.0f} tok/s  {r['step_ms']:7.1f} ms  "
    f"MFU {r['mfu'] or 0:.3f}  {r['peak_memory_gib'] or 0:5.1f} GiB  {r['resolved'].get('compile', '')}  {extra}"
)
PY
row() { python3 /tmp/levers-err/row.py "$1"; }
# One JSON line per config in OUT_DIR/bench.jsonl, and its row printed as soon as it is measured (a command
# stopped at its limit keeps what it measured); stderr of each run in /tmp/levers-err/NAME.err.
run() { local name=$1; shift
  local line
  line=$($B "$@" 2> "/tmp/levers-err/$name.err" | tail -1 | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); \
r['name']='$name'; print(json.dumps(r))") || { echo "$name failed: $(tail -2 "/tmp/levers-err/$name.err")"; return; }
  echo "$line" >> "$out/bench.jsonl"
  row "$line" | tee -a "$out/summary.txt"; }
if [ "$part" = modes ]; then
  # whole-model compile and CUDA graphs by size (the auto rule's threshold), Muon's batched step
  for size in "125m --batch_size 32 --block_size 1024" "350m --batch_size 16 --block_size 1024"; do
    n=${size%% *}
    run $n-blocks --size $size --perf.compile_mode blocks --perf.cuda_graphs false
    run $n-model --size $size --perf.compile_mode model --perf.cuda_graphs false
    run $n-graphs --size $size --perf.compile_mode model --perf.cuda_graphs true
  done
  run 125m-muon-graphs --size 125m --batch_size 32 --block_size 1024 --optimizer muon
  run 1b-muon --size 1b --block_size 2048 --batch_size 8 --optimizer muon
fi
if [ "$part" = user125 ]; then
  # the user's path at 125m under the auto rule, beside per-block compile (train: auto batch, eval, samples)
  for v in auto "blocks --perf.cuda_graphs false"; do
    n=${v%% *}
    $G train --data @stdlib --size 125m --max_steps 40 --log_interval 5 --no_progress --out "/tmp/u125-$n" \
      --perf.compile_mode $v > "/tmp/levers-err/user125-$n.log" 2>&1
    echo "user 125m $n: $(grep -E 'batch:|first step done|^done|error' "/tmp/levers-err/user125-$n.log" \
      | tr '\n' ' ')" | tee -a "$out/summary.txt"
  done
fi
if [ "$part" = bench ]; then
  small="--size 125m --model.d_model 512 --model.n_layers 12 --model.n_heads 8 --model.n_kv_heads 8
    --model.ffn_dim 1408 --model.vocab_size 8192 --block_size 512 --batch_size 32"
  run 1b-adamw-hf --size 1b --block_size 2048 --batch_size 8 --compare hf
  run 1b-muon --size 1b --block_size 2048 --batch_size 8 --optimizer muon
  run 125m-adamw --size 125m --block_size 1024 --batch_size 32
  run 125m-muon --size 125m --block_size 1024 --batch_size 32 --optimizer muon
  run small-blocks-hf $small --compare hf
  run small-model $small --perf.compile_mode model
  run small-model-graphs $small --perf.compile_mode model --perf.cuda_graphs true
fi
if [ "$part" = kernels ]; then
  python3 -m gptoughts env 2>&1 | sed -n '/ttention/,/^$/p' | tee -a "$out/summary.txt"
  python3 -m pytest tests/perf/test_attention_gpu.py -q -p no:cacheprovider 2>&1 | tail -6 | tee -a "$out/summary.txt"
  timeout 200 python3 bench/attention.py --out "$out/attention.jsonl" 2>&1 | tail -30 | tee -a "$out/summary.txt"
  one="--size 1b --block_size 2048 --batch_size 8"
  run 1b $one
  run 1b-fa4 $one --perf.sdpa_backend fa4
  run 1b-bf16-moments $one --optimizer_states bf16
  [ -n "${EIGHT_BIT:-}" ] && run 1b-8bit-moments $one --optimizer_states 8bit  # 0.71x on an H100 (BENCHMARKS)
  run 1b-fa4-bf16-moments $one --perf.sdpa_backend fa4 --optimizer_states bf16
fi
if [ "$part" = parity ]; then
  SIZE=350m BATCH_SIZE=8 timeout 420 bash bench/fp8_vs_bf16_loss.sh "$out/parity" bf16states="--optimizer_states bf16" \
    int8states="--optimizer_states 8bit" 2>&1 | tail -12 | tee -a "$out/summary.txt"
  for run in cold warm; do
    python3 -m cProfile -o "$out/startup-$run.prof" -m gptoughts train --data @stdlib --size 1b --batch_size 8 \
      --grad_accum 1 --max_steps 1 --eval_interval 0 --no_progress --out /tmp/su-prof > "/tmp/levers-err/su-$run.log" 2>&1
    echo "1b b8 $run: $(grep -E 'first step done|error' "/tmp/levers-err/su-$run.log")" | tee -a "$out/summary.txt"
  done
fi
if [ "$part" = ttl ]; then
  for n in 1 2; do
    python3 -X importtime -c "import gptoughts.api, gptoughts.training.build, gptoughts.training.setup, torch; \
torch.zeros(1, device='cuda')" 2> "$out/importtime-$n.txt"
    python3 - "$out/importtime-$n.txt" <<'PY' | tee -a "$out/summary.txt"
import sys
rows = []
for line in open(sys.argv[1]):
    p = line.split("|")
    if line.startswith("import time:") and len(p) == 3 and p[1].strip().isdigit():
        rows.append((int(p[1]), p[2].rstrip()))
print("imports: total", sum(c for c, n in rows if not n.startswith("  ")) / 1e6, "s; top:",
      "; ".join(f"{n.strip()} {c / 1e6:.2f}" for c, n in sorted(rows, reverse=True)[:12]))
PY
  done
  s125="--size 125m --block_size 1024 --batch_size 32"
  run 125m-compiled $s125
  run 125m-eager $s125 --compile false
fi
if [ -n "${PYC:-}" ]; then
  # A machine with bytecode caches, as a pip install leaves them (the GPU machines' Python writes none: every
  # process compiles the sources of torch, sympy and transformers it imports): caches under /tmp/pyc, filled by
  # one import of what both sides load.
  python3 -c "import sys, os; print('dont_write_bytecode', sys.flags.dont_write_bytecode, os.environ.get('PYTHONDONTWRITEBYTECODE'))"
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=/tmp/pyc
  for i in 1 2; do
    t0=$(date +%s.%N)
    python3 -c "import torch, torch._dynamo, torch._inductor.compile_fx, transformers, transformers.trainer, \
matplotlib.pyplot, gptoughts.api, gptoughts.training.build, gptoughts.training.setup, gptoughts.training.trainer"
    echo "pyc warm-up $i: $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a "$out/summary.txt"
  done
fi
if [ "$part" = ttl ] || [ "$part" = ttl-fresh ]; then
  tf=$(python3 -c "import os, transformers; print(os.path.dirname(transformers.__file__))")
  python3 bench/time_to_loss.py --data "$tf" --max_tokens 10_000_000 --grad_accum 1 --timeout 170 \
    --variants "${VARIANTS:-adamw,speedrun,sr-eager,hf}" --define "sr-eager=llama-125m-speedrun --perf.compile false" \
    --out /tmp/ttl 2>&1 | tail -25 | tee -a "$out/summary.txt"
  mkdir -p "$out/ttl"
  cp /tmp/ttl/results.json /tmp/ttl/*.log "$out/ttl/" 2>/dev/null
  for d in /tmp/ttl/*/; do [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$out/ttl/$(basename "$d").metrics.jsonl"; done
fi
if [ "$part" = ttl-warm ]; then
  # the speedrun variant as a second run of the same config (the usual compile caches, warmed by a first run),
  # then the start-up of a fresh-cache speedrun run under cProfile
  tf=$(python3 -c "import os, transformers; print(os.path.dirname(transformers.__file__))")
  for n in first second; do
    python3 bench/time_to_loss.py --data "$tf" --max_tokens 10_000_000 --grad_accum 1 --timeout 170 \
      --variants speedrun --compile_cache shared --target 2.12 --out "/tmp/ttl-warm-$n" 2>&1 | tail -5 \
      | sed "s/^/$n: /" | tee -a "$out/summary.txt"
    mkdir -p "$out/ttl-warm-$n"
    cp /tmp/ttl-warm-$n/results.json /tmp/ttl-warm-$n/*.log "$out/ttl-warm-$n/" 2>/dev/null
  done
  TORCHINDUCTOR_CACHE_DIR=/tmp/su-cache/inductor TRITON_CACHE_DIR=/tmp/su-cache/triton python3 -m cProfile \
    -o /tmp/su.prof -m gptoughts train llama-125m-speedrun --data "$tf" --size 125m --tokenizer bpe:8192 \
    --block_size 1024 --batch_size 32 --grad_accum 1 --max_steps 13 --eval.eval_interval 12 --eval.eval_batches 20 \
    --eval.sample_prompts= --checkpoint.checkpoints false --run.progress false --out /tmp/su-run --overwrite \
    > "$out/startup-profile.log" 2>&1
  python3 -c "import pstats; p = pstats.Stats('/tmp/su.prof'); p.sort_stats('cumulative').print_stats(90)" \
    > "$out/startup-profile.txt"
  grep -E 'first step done|error' "$out/startup-profile.log" | tee -a "$out/summary.txt"
fi
if [ "$part" = inductor ]; then
  small="--size 125m --model.d_model 512 --model.n_layers 12 --model.n_heads 8 --model.n_kv_heads 8
    --model.ffn_dim 1408 --model.vocab_size 8192 --block_size 512 --batch_size 32"
  for env in default TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 TORCHINDUCTOR_ENABLE_PDL=1; do
    for shape in 125m small; do
      if [ $shape = 125m ]; then args="--size 125m --block_size 1024 --batch_size 32"; else args=$small; fi
      rm -rf /tmp/ind-cache; t0=$(date +%s.%N)
      line=$(env ${env/default/X=1} TORCHINDUCTOR_CACHE_DIR=/tmp/ind-cache/i TRITON_CACHE_DIR=/tmp/ind-cache/t \
        $B $args 2> /tmp/levers-err/ind.err | tail -1)
      wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
      echo "$line" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps({'env': '$env', \
'shape': '$shape', 'wall_s': $wall, 'tokens_per_s': r['tokens_per_s'], 'step_ms': r['step_ms']}))" \
        | tee -a "$out/inductor.jsonl" || echo "$env $shape failed: $(tail -2 /tmp/levers-err/ind.err)"
    done
  done
fi
if [ "$part" = pool ]; then
  tf=$(python3 -c "import os, transformers; print(os.path.dirname(transformers.__file__))")
  for round in 1 2; do
    for early in early late; do
      rm -rf /tmp/pool-cache
      TORCHINDUCTOR_CACHE_DIR=/tmp/pool-cache/i TRITON_CACHE_DIR=/tmp/pool-cache/t EARLY=$early python3 -c "
import os, sys
from gptoughts.training import build as b
if os.environ['EARLY'] == 'late':
    b.start_compile_workers = lambda *a: None
from gptoughts.cli import main
sys.exit(main(sys.argv[1:]))" train llama-125m-speedrun --data "$tf" --size 125m --tokenizer bpe:8192 \
        --block_size 1024 --batch_size 32 --grad_accum 1 --max_steps 13 --eval.eval_interval 12 --eval.eval_batches 20 \
        --data.val_fraction 0.02 --eval.sample_prompts= --checkpoint.checkpoints false --run.progress false \
        --out /tmp/pool-run --overwrite > /tmp/levers-err/pool.log 2>&1
      echo "$round $early: $(grep -E 'first step done|error' /tmp/levers-err/pool.log) | done line: $(grep -E '^done' /tmp/levers-err/pool.log | cut -c1-60)" \
        | tee -a "$out/summary.txt"
    done
  done
  # where an eager start-up of the same run goes (shards cached by now), under cProfile
  python3 -m cProfile -o /tmp/pool.prof -m gptoughts train llama-125m-speedrun --data "$tf" --size 125m \
    --tokenizer bpe:8192 --block_size 1024 --batch_size 32 --grad_accum 1 --max_steps 1 --eval.eval_interval 0 \
    --data.val_fraction 0.02 --eval.sample_prompts= --checkpoint.checkpoints false --run.progress false \
    --perf.compile false --out /tmp/pool-prof --overwrite > /tmp/levers-err/pool-prof.log 2>&1
  grep -E 'first step done|error' /tmp/levers-err/pool-prof.log | tee -a "$out/summary.txt"
  python3 -c "import pstats; p = pstats.Stats('/tmp/pool.prof'); p.sort_stats('cumulative').print_stats(70)" \
    > "$out/eager-startup-profile.txt"
  python3 -c "import pstats; p = pstats.Stats('/tmp/pool.prof'); p.sort_stats('cumulative').print_stats('gptoughts', 60)" \
    >> "$out/eager-startup-profile.txt"
fi
if [ "$part" = small ]; then
  mkdir -p "$out/small"
  s47="--size 125m --model.d_model 512 --model.n_layers 12 --model.n_heads 8 --model.n_kv_heads 8 --model.ffn_dim 1408
    --tokenizer bpe:8192 --block_size 512"
  cat > /tmp/levers-err/steady.py <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
evals = {r["step"] for r in rows if "val_loss" in r}
log = sorted(r["step"] for r in rows if "tokens_per_s" in r)
after_eval = {s for i, s in enumerate(log) if i and log[i - 1] in evals}
tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 5 and r["step"] not in evals | after_eval]
print(f"steady {sorted(tps)[len(tps) // 2]:,.0f} tok/s (median of {len(tps)} windows)" if tps else "steady n/a")
PY
  for shape in ${SHAPES:-125m s47 350m gpt2}; do
    case $shape in
      125m) args="--size 125m" ;; s47) args=$s47 ;; 350m) args="--size 350m" ;; gpt2) args="--model gpt2 --size small" ;;
    esac
    for v in ${VARIANTS:-old auto model graphs}; do
      case $v in
        old) flags="--perf.compile_mode blocks --perf.cuda_graphs false" ;; auto) flags="" ;;
        model) flags="--perf.compile_mode model" ;; graphs) flags="--perf.compile_mode model --perf.cuda_graphs true" ;;
      esac
      log="$out/small/$shape-$v.log"; run_dir="/tmp/small-$shape-$v"
      t0=$(date +%s.%N)
      steps=40; if [ $shape = 350m ]; then steps=16; fi
      $G train --data @stdlib $args $flags --max_steps $steps --eval_interval $((steps / 2)) --log_interval 2 --no_progress \
        --out "$run_dir" --overwrite > "$log" 2>&1
      wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
      steady=$(python3 /tmp/levers-err/steady.py "$run_dir/metrics.jsonl" 2>&1 | tail -1)
      echo "$shape $v: wall ${wall}s; $steady; $(grep -E 'batch:|compile:|first step done|^done|error|Error' "$log" \
        | cut -c1-260 | tr '\n' ' ')" | tee -a "$out/small.txt"
    done
  done
fi
if [ "$part" = lora ]; then
  for d in ${LORA_DROPOUTS:-0 0.05}; do
    python3 bench/finetune_vs_peft.py --size 1b --seq 2048 --batch 4 --steps 15 --warmup 5 --dropout $d \
      --variants "${LORA_VARIANTS:-[]}" --out "$out/lora-dropout$d.json" > "$out/lora-dropout$d.log" 2>&1
    grep -A8 "^LoRA fine-tuning" "$out/lora-dropout$d.log" | tee -a "$out/lora.txt"
  done
fi

if [ "$part" = fp8 ]; then
  python3 bench/gpu_matrix.py --out "$out/fp8.jsonl" --only 3b-fp8-levers --steps 10 --warmup 4 2>&1 \
    | grep -v "^W1\|^  " | tee "$out/fp8.txt"
  if [ "${PARITY:-1}" = 1 ]; then
    bash bench/fp8_vs_bf16_loss.sh "$out/parity" fp8="--fp8" fp8_fast="--fp8 --perf.fp8_fast_accum true" \
      > "$out/parity.log" 2>&1
    tail -40 "$out/parity.log" | tee -a "$out/fp8.txt"
  fi
fi

if [ "$part" = checkpoints ]; then
  T="$G train --data @stdlib --no_progress --size 1b --max_steps 4 --eval_interval 2 --log_interval 1"
  for mode in background synchronous; do
    extra=""; [ $mode = synchronous ] && extra="--checkpoint.async_save false"
    $T $extra --out "/tmp/ck-$mode" > "$out/ck-$mode.log" 2>&1
    python3 - "/tmp/ck-$mode" "$mode" <<'PY' | tee -a "$out/checkpoints.txt"
import json, sys
run, mode = sys.argv[1], sys.argv[2]
s = json.load(open(f"{run}/summary.json"))
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
blocked = [(r["step"], round(r["checkpoint_blocked_s"], 2)) for r in rows if "checkpoint_blocked_s" in r]
tps = [(r["step"], round(r["tokens_per_s"])) for r in rows if "tokens_per_s" in r]
print(f"{mode}: whole run {s['tokens_per_s']:,.0f} tok/s in {s['wall_s']:.1f} s; checkpoint blocked s {blocked}; "
      f"windows {tps}")
PY
  done
  $G train --resume auto --out /tmp/ck-background --max_steps 5 --no_progress > "$out/ck-resume.log" 2>&1
  echo "resume of the background run: exit $?; $(grep -E 'resumed from' "$out/ck-resume.log")" | tee -a "$out/checkpoints.txt"
fi

if [ "$part" = ce-wgrad ]; then
  python3 bench/ce_wgrad.py --out "$out/ce_wgrad.jsonl" 2>&1 | grep -v -i warn | tee "$out/ce_wgrad.txt"
fi
