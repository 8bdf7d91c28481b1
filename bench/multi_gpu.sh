#!/usr/bin/env bash
# Usage (2-GPU machine): bash bench/multi_gpu.sh OUT_DIR [ddp|fsdp|both]
#   ddp:  NCCL DDP on 2 GPUs + auto batch size + compile + resume, on real shards (stdlib, bpe:32768), and the
#         same config on one GPU (the 2026-11-21 check).
#   fsdp: FSDP2 on NCCL, 1b Llama at seq 2048 bf16 compile, DDP then FSDP with the same config side by side
#         (tokens/s and memory per GPU from metrics.jsonl); then FSDP checkpoints: save at step 10, resume to 15
#         under FSDP, and resume the same checkpoint on one GPU.
set -uo pipefail
out=$1
what=${2:-both}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
last() {  # last logged tokens/s and GPU memory of a run
  python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]+'/metrics.jsonl') if 'tokens_per_s' in l][-1]; print(f\"{sys.argv[2]}: step {r['step']} loss {r['loss']:.4f} {r['tokens_per_s']:,.0f} tok/s, GPU memory {r.get('gpu/mem_used_gib', float('nan')):.1f} GiB\")" "$@"
}
if [[ $what == ddp || $what == both ]]; then
  common=(default --size 125m --data @stdlib --tokenizer bpe:32768 --block_size 1024 --batch_size auto
          --train.global_batch_tokens 262144 --learning_rate 6e-4 --warmup_steps 5 --eval_interval 20
          --train.eval_batches 4 --log_interval 5 --save_interval 20 --no_progress)
  python3 -m gptoughts prepare --data @stdlib --out /tmp/warm --tokenizer bpe:32768 > /dev/null 2>&1
  torchrun --standalone --nproc_per_node=2 -m gptoughts train "${common[@]}" --max_steps 40 --out "$out/ddp" 2>&1 | grep -v -i warn | tail -12
  echo "--- resume to 50"
  torchrun --standalone --nproc_per_node=2 -m gptoughts train "${common[@]}" --max_steps 50 --resume auto --out "$out/ddp" 2>&1 | grep -v -i warn | tail -6
  echo "--- single GPU, same config"
  python3 -m gptoughts train "${common[@]}" --max_steps 20 --out "$out/single" 2>&1 | grep -v -i warn | tail -6
fi
if [[ $what == fsdp || $what == both ]]; then
  big=(default --size 1b --data @stdlib --tokenizer bytes --block_size 2048 --batch_size 8 --precision bf16
       --compile true --max_steps 25 --log_interval 5 --eval_interval 0 --train.checkpoints false
       --train.sample_prompts= --no_progress)
  for s in ddp fsdp; do
    torchrun --standalone --nproc_per_node=2 -m gptoughts train "${big[@]}" --parallel.strategy $s --out "$out/1b-$s" 2>&1 | grep -v -i warn | tail -3
    last "$out/1b-$s" "1b $s x2"
  done
  small=(default --size 125m --data @stdlib --tokenizer bytes --block_size 1024 --batch_size 16 --precision bf16
         --compile true --log_interval 5 --eval_interval 10 --train.eval_batches 3 --save_interval 10 --no_progress)
  echo "--- fsdp: 10 steps, then resume to 15 under fsdp, and the step-10 checkpoint on one GPU"
  torchrun --standalone --nproc_per_node=2 -m gptoughts train "${small[@]}" --parallel.strategy fsdp --max_steps 10 --out "$out/f" 2>&1 | grep -v -i warn | tail -4
  torchrun --standalone --nproc_per_node=2 -m gptoughts train "${small[@]}" --parallel.strategy fsdp --max_steps 15 --resume auto --out "$out/f" 2>&1 | grep -v -i warn | tail -3
  last "$out/f" "fsdp resumed"
  python3 -m gptoughts train "${small[@]}" --batch_size 32 --max_steps 15 --resume "$out/f/checkpoints/step_000010" --out "$out/f1" 2>&1 | grep -v -i warn | tail -3
  last "$out/f1" "one GPU from the fsdp checkpoint"
fi
