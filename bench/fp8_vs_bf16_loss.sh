#!/usr/bin/env bash
# 3b Llama, 300 steps on real shards (the GPU machine's Python stdlib, bpe:32768), same seed and data order:
# bf16, then each variant. Prints, per variant, the mean train loss of steps 251-300, the last val loss, the
# tokens/s after step 50, and their ratios to the bf16 run.
# Usage: bash bench/fp8_vs_bf16_loss.sh OUT_DIR [NAME="FLAGS" ...]
#   default variants: fp8="--fp8"
#   e.g. bash bench/fp8_vs_bf16_loss.sh /tmp/o fp8="--fp8" fp8_end1="--fp8 --perf.fp8_bf16_end_layers 1" \
#        bf16_seed1="--train.seed 1"
#   SIZE=350m BATCH_SIZE=8 bash bench/fp8_vs_bf16_loss.sh ...: another size and micro-batch (default 3b, 4)
set -euo pipefail
out=${1:?out dir}
shift
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=("fp8=--fp8")
common=(default --size "${SIZE:-3b}" --data @stdlib --tokenizer bpe:32768 --block_size 2048 --batch_size "${BATCH_SIZE:-4}" --max_steps 300
        --learning_rate 3e-4 --warmup_steps 30 --eval_interval 100 --train.eval_batches 4 --log_interval 10
        --train.sample_interval 0 --train.checkpoints false --compile true --no_progress --overwrite)
python3 -m gptoughts train "${common[@]}" --precision bf16 --out "$out/bf16"
names=()
for v in "${variants[@]}"; do
  name=${v%%=*}; flags=${v#*=}
  # shellcheck disable=SC2086  # flags are word-split on purpose
  python3 -m gptoughts train "${common[@]}" --precision bf16 $flags --out "$out/$name"
  names+=("$name")
done
python3 - "$out" "${names[@]}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
def tail(run):
    rows = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl")]
    train = [r["loss"] for r in rows if "loss" in r and r["step"] > 250]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 50]
    return {"train_loss_last50": sum(train) / len(train), "val_loss": val[-1], "tokens_per_s": sum(tps) / len(tps)}
base = tail("bf16")
res = {"bf16": base}
for n in names:
    r = tail(n)
    r["train_loss_rel_diff"] = r["train_loss_last50"] / base["train_loss_last50"] - 1
    r["val_loss_rel_diff"] = r["val_loss"] / base["val_loss"] - 1
    r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    res[n] = r
print(json.dumps(res, indent=1))
PY
