#!/usr/bin/env bash
# Attention backends on one GPU (issue 13 item 2): numerics, kernel timings, and the whole 1b step with each.
# FlashAttention-4 is not on the GPU machines: install its wheels (flash_attn_4, nvidia_cutlass_dsl +
# libs_base + libs_cu13, quack_kernels, apache_tvm_ffi, torch_c_dlpack_ext) with
#   python3 -m pip install --no-deps --target /tmp/site WHEELS...
# then, from the repo root:  OUT=/some/dir bash bench/attention_gpu.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.:${FA4_SITE:-/tmp/site}:${FA4_SITE:-/tmp/site}/nvidia_cutlass_dsl/dsl_packages
python -m gptoughts env | tee "$OUT/attention-env.txt"
python -m pytest tests/perf/test_attention_gpu.py tests/perf/test_attention.py -q -p no:cacheprovider 2>&1 \
  | tail -15 | tee "$OUT/attention-tests.txt"
python bench/attention.py --out "$OUT/attention.jsonl" | tee "$OUT/attention.txt"
for backend in auto fa4; do
  python -m gptoughts bench --size 1b --block_size 2048 --batch_size 8 --perf.sdpa_backend $backend --json \
    > "$OUT/bench-1b-$backend.json" 2> "$OUT/bench-1b-$backend.err"
  echo "1b sdpa_backend=$backend: exit $? $(python -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.1f} ms, mfu {r['mfu']}\")" "$OUT/bench-1b-$backend.json" 2>/dev/null || tail -1 "$OUT/bench-1b-$backend.err")"
done
