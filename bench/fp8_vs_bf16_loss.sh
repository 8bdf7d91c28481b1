#!/usr/bin/env bash
# 3b Llama, 300 steps on real shards (the GPU machine's Python stdlib, bpe:32768), bf16 then fp8 tensorwise,
# same seed and data order. Prints the mean train loss of the last 50 steps of each and their ratio.
# Usage: bash bench/fp8_vs_bf16_loss.sh OUT_DIR
set -euo pipefail
out=${1:?out dir}
common=(default --size 3b --data @stdlib --tokenizer bpe:32768 --block_size 2048 --batch_size 4 --max_steps 300
        --learning_rate 3e-4 --warmup_steps 30 --eval_interval 100 --train.eval_batches 4 --log_interval 10
        --train.sample_interval 0 --train.checkpoints false --compile true --no_progress --overwrite)
python3 -m gptoughts train "${common[@]}" --precision bf16 --out "$out/bf16"
python3 -m gptoughts train "${common[@]}" --precision bf16 --fp8 --out "$out/fp8"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def tail_loss(run):
    rows = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl")]
    train = [r for r in rows if "loss" in r and r["step"] > 250]
    val = [r for r in rows if "val_loss" in r]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 50]
    return sum(r["loss"] for r in train) / len(train), val[-1]["val_loss"], sum(tps) / len(tps)
b, f = tail_loss("bf16"), tail_loss("fp8")
print(json.dumps({"bf16": {"train_loss_last50": b[0], "val_loss": b[1], "tokens_per_s": b[2]},
                  "fp8": {"train_loss_last50": f[0], "val_loss": f[1], "tokens_per_s": f[2]},
                  "train_loss_rel_diff": f[0] / b[0] - 1, "val_loss_rel_diff": f[1] / b[1] - 1,
                  "speedup": f[2] / b[2]}, indent=1))
PY
