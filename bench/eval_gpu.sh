#!/usr/bin/env bash
# Evaluation on a GPU (issue 17): a small run trained on the stdlib, then `gptoughts eval` with a custom
# multiple-choice file, a generation file and the same tasks through lm-evaluation-harness (a task folder reading
# the local files), in bf16 on CUDA; then periodic task evaluation during an FSDP run on every GPU (harness and
# file tasks, scored on every rank of the sharded model). Usage: bash bench/eval_gpu.sh OUT_DIR [all|fsdp]
set -uo pipefail
out=$1
what=${2:-all}
mkdir -p "$out/tasks"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 - "$out/tasks" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
mc = [{"context": c, "choices": [a, b], "answer": 0} for c, a, b in [
    ("import", " os", " banana"), ("def f(x):\n    return", " x", " )))"), ("for i in", " range(", " ==="),
    ("class Foo", ":", " 7"), ("if __name__ ==", " '__main__':", " lambda")]]
gen = [{"prompt": p, "expected": e, "until": ["\n"]} for p, e in [
    ("import o", "s"), ("if __name__ == '__main__", "':"), ("    return Non", "e")]]
(d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
(d / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
for name, data, body in [
    ("h_mc", "mc.jsonl", 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
     'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'),
    ("h_gen", "gen.jsonl", 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{expected}}"\n'
     'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 64\n  do_sample: false\n'
     "metric_list:\n  - metric: exact_match\n    regexes_to_ignore: ['^\\\\s+', '\\\\s+$']\n")]:
    (d / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                    f"    test: {d / data}\ntest_split: test\n{body}")
PY
t=$out/tasks
common=(--data @stdlib --tokenizer bytes --no_progress --train.checkpoints true --train.sample_prompts=)
if [[ $what == all ]]; then
python3 -m gptoughts train --size 125m --block_size 512 --batch_size 16 --max_steps 300 --eval_interval 300 \
  "${common[@]}" --out "$out/run125m" > "$out/train.log" 2>&1; tail -2 "$out/train.log"
python3 -m gptoughts eval "$out/run125m" --tasks "$t/mc.jsonl" --tasks "$t/gen.jsonl" --tasks h_mc,h_gen \
  --task_dir "$t" --json > "$out/eval.json" 2> "$out/eval.err"; echo "eval rc $?"; cat "$out/eval.json"
fi
n=$(nvidia-smi -L | wc -l)
torchrun --standalone --nproc_per_node="$n" -m gptoughts train --size debug --max_steps 20 --eval_interval 10 \
  "${common[@]}" --parallel.strategy fsdp --eval_tasks "$t/mc.jsonl,h_mc,$t/gen.jsonl" --eval.eval_task_dir "$t" \
  --out "$out/fsdp" > "$out/fsdp.log" 2>&1; echo "fsdp rc $?"
grep -E "tasks|error|Error" "$out/fsdp.log" | head -8
