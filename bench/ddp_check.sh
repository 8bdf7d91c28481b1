#!/usr/bin/env bash
# Usage (2-GPU machine): bash bench/ddp_check.sh OUT_DIR
# NCCL DDP on 2 GPUs + auto batch size + compile + resume, on real shards (stdlib, bpe:32768).
set -uo pipefail
out=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
common=(default --size 125m --data @stdlib --tokenizer bpe:32768 --block_size 1024 --batch_size auto
        --train.global_batch_tokens 262144 --learning_rate 6e-4 --warmup_steps 5 --eval_interval 20
        --train.eval_batches 4 --log_interval 5 --save_interval 20 --no_progress)
python3 -m gptoughts prepare --data @stdlib --out /tmp/warm --tokenizer bpe:32768 > /dev/null 2>&1
torchrun --standalone --nproc_per_node=2 -m gptoughts train "${common[@]}" --max_steps 40 --out "$out/ddp" 2>&1 | grep -v -i warn | tail -12
echo "--- resume to 50"
torchrun --standalone --nproc_per_node=2 -m gptoughts train "${common[@]}" --max_steps 50 --resume auto --out "$out/ddp" 2>&1 | grep -v -i warn | tail -6
echo "--- single GPU, same config"
python3 -m gptoughts train "${common[@]}" --max_steps 20 --out "$out/single" 2>&1 | grep -v -i warn | tail -6
