#!/usr/bin/env bash
# 3b Llama, 300 steps on real shards (the GPU machine's Python stdlib, bpe:32768), same data order per seed:
# bf16, then each variant. Prints, per variant, the mean train loss of steps 251-300, the last val loss, the
# tokens/s after step 50, and their ratios to the bf16 run of the same seed; over several seeds, the means too.
# Usage: bash bench/fp8_vs_bf16_loss.sh OUT_DIR [NAME="FLAGS" ...]
#   default variants: fp8="--fp8"
#   e.g. bash bench/fp8_vs_bf16_loss.sh /tmp/o fp8="--fp8" fp8_end1="--fp8 --perf.fp8_bf16_end_layers 1"
#   SIZE=350m BATCH_SIZE=8 bash bench/fp8_vs_bf16_loss.sh ...: another size and micro-batch (default 3b, 4)
#   SEEDS="1 2 3": each run once per seed (--train.seed; the seed also draws the validation split), into
#     OUT_DIR/NAME-sSEED; the summary gives each seed's ratios and the ratio of the means
#   RUNS=bf16 / RUNS=variants: one side only (two GPUs, one each, into the same OUT_DIR); SUMMARY=1: only the
#     summary of whatever runs OUT_DIR holds
set -euo pipefail
out=${1:?out dir}
shift
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=("fp8=--fp8")
seeds=(${SEEDS:-})
common=(default --size "${SIZE:-3b}" --data @stdlib --tokenizer bpe:32768 --block_size 2048 --batch_size "${BATCH_SIZE:-4}" --max_steps 300
        --learning_rate 3e-4 --warmup_steps 30 --eval_interval 100 --train.eval_batches 4 --log_interval 10
        --train.sample_interval 0 --train.checkpoints false --compile true --no_progress --overwrite)
run() {  # NAME FLAGS...: one run per seed (or one run without SEEDS)
  local name=$1
  shift
  if [ ${#seeds[@]} -eq 0 ]; then
    python3 -m gptoughts train "${common[@]}" --precision bf16 "$@" --out "$out/$name"
  else
    for s in "${seeds[@]}"; do
      python3 -m gptoughts train "${common[@]}" --precision bf16 "$@" --train.seed "$s" --out "$out/$name-s$s"
    done
  fi
}
if [ "${SUMMARY:-0}" != 1 ]; then
  [ "${RUNS:-all}" != variants ] && run bf16
  if [ "${RUNS:-all}" != bf16 ]; then
    for v in "${variants[@]}"; do
      # shellcheck disable=SC2086  # flags are word-split on purpose
      run "${v%%=*}" ${v#*=}
    done
  fi
fi
python3 - "$out" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
def tail(run):
    rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
    train = [r["loss"] for r in rows if "loss" in r and r["step"] > 250]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 50]
    if not train or not val:
        return None  # a run cut short
    return {"train_loss_last50": sum(train) / len(train), "val_loss": val[-1], "tokens_per_s": sum(tps) / len(tps)}
runs = {}  # name -> seed ("" without SEEDS) -> figures
for d in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()):
    name, seed = (m.group(1), m.group(2)) if (m := re.fullmatch(r"(.+)-s(\d+)", d.name)) else (d.name, "")
    if (t := tail(d)) is not None:
        runs.setdefault(name, {})[seed] = t
keys = ("train_loss_last50", "val_loss", "tokens_per_s")
def ratios(r, b):
    return {"train_loss_rel_diff": r[keys[0]] / b[keys[0]] - 1, "val_loss_rel_diff": r[keys[1]] / b[keys[1]] - 1,
            "speedup": r[keys[2]] / b[keys[2]]}
base = runs.get("bf16", {})
res = {}
for name, by_seed in runs.items():
    entry = {seed or "run": {**r, **(ratios(r, base[seed]) if name != "bf16" and seed in base else {})}
             for seed, r in sorted(by_seed.items())}
    if len(by_seed) > 1:
        mean = {k: sum(r[k] for r in by_seed.values()) / len(by_seed) for k in keys}
        common_seeds = [s for s in by_seed if s in base]
        if name != "bf16" and common_seeds:
            bmean = {k: sum(base[s][k] for s in common_seeds) / len(common_seeds) for k in keys}
            mine = {k: sum(by_seed[s][k] for s in common_seeds) / len(common_seeds) for k in keys}
            mean |= {"seeds": common_seeds, **ratios(mine, bmean)}
        entry["mean"] = mean
    res[name] = entry
print(json.dumps(res, indent=1))
PY
