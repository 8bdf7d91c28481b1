#!/usr/bin/env bash
# The wheels `gptoughts bench --compare torchtitan` needs on the GPU machine, which has no network (and has torch
# 2.11, triton, tokenizers, safetensors, tensorboard, einops, pillow, rich, typing-extensions, jinja2, filelock,
# networkx). Only what the compare imports: torchtitan and the modules its Llama 3, parallelize, loss and
# cudagraph code import (spmd_types; tyro, through its config package, and tyro's own docstring-parser and
# typeguard), plus torchao for fp8 runs (ours and torchtitan's float8 both go through it). Not torchtitan's whole
# Requires-Dist: torchdata, datasets, wandb and torch_checkpointing serve its trainer, data and checkpoints, which
# the compare does not import.
# Usage, on a machine with network, from the repo root:  bash bench/peer_wheels.sh [DIR]   (DIR: .whl)
# Then on the GPU machine (with DIR carried over):
#   python3 -m pip install --no-deps --target .peer .whl/*.whl
#   PYTHONPATH=.peer gptoughts bench --size 1b --compare torchtitan
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" \
  torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0 torchao==0.18.0
python3 - "$dir" <<'PY'
import os, sys
d = sys.argv[1]
wheels = sorted(f for f in os.listdir(d) if f.endswith(".whl"))
total = sum(os.path.getsize(os.path.join(d, f)) for f in wheels)
for f in wheels:
    print(f"{os.path.getsize(os.path.join(d, f)) / 2**20:7.2f} MiB  {f}")
print(f"{total / 2**20:7.2f} MiB  total, {len(wheels)} wheels in {d}/")
if total > 60 * 2**20:
    sys.exit("more than 60 MiB: too large to carry to the GPU machine")
PY
