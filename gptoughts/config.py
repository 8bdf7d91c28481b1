"""The typed configuration tree, TOML presets and dotted overrides.

A run is described by one :class:`Config`: sections ``model``, ``data``, ``train``, ``eval``, ``checkpoint``,
``recovery``, ``perf``, ``parallel``, ``run`` and ``lora``. Each section is a dataclass whose fields are documented where they are declared.
Configs are data: TOML files (``gptoughts/presets/*.toml`` or a user's file) and ``--section.key value``
overrides, never Python code. Validation is strict: an unknown key or a wrong type raises
:class:`~gptoughts.errors.ConfigError` naming the closest valid key.

The ``[model]`` table is special: besides ``family``, ``size`` and ``init_from`` it accepts any field of the
chosen family's architecture dataclass (e.g. ``n_layers``), validated by :func:`gptoughts.models.model_args`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from gptoughts.coerce import build_dataclass, coerce
from gptoughts.errors import ConfigError, did_you_mean

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "quickstart"


@dataclass
class ModelConfig:
    family: str = "llama"
    """Model family: llama, … (see ``gptoughts.models.FAMILIES``)."""
    size: str = "debug"
    """Size preset of the family (``debug`` always exists and runs on CPU in seconds). A run that names a size
    starts from that size's training defaults (``presets/sizes.toml``: block size, learning rate, batch)."""
    init_from: str | None = None
    """A Hugging Face model to start from instead of random init (``gptoughts finetune --model``): a local folder,
    or a hub id ``ORG/NAME`` read from the Hugging Face cache (downloaded into it when online). Its config, weights
    and tokenizer are used; llama/mistral/qwen2/qwen3, gpt2 and deepseek_v3 run natively, others through
    transformers."""
    trust_remote_code: bool = False
    """Let transformers run the model folder's own Python code (models it does not ship); off unless asked."""
    overrides: dict[str, Any] = field(default_factory=dict, metadata={"catch_all": True})
    """Family architecture fields that override the size preset (any other key of ``[model]`` lands here)."""


@dataclass
class PhaseConfig:
    name: str = "phase"
    """Label shown in logs and metrics."""
    sources: list[str] = field(default_factory=list)
    """Paths (as given in ``data.sources``) drawn from in this phase."""
    weights: list[float] = field(default_factory=list)
    """Sampling weight per source; empty means proportional to each source's token count."""
    tokens: int | None = None
    """Token budget of the phase (global, all ranks); None: until training stops. Phases run in order."""


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=list)
    """Corpus: text files, folders (recursive), .jsonl, .parquet, saved HF datasets. ``@stdlib`` is the
    running interpreter's standard library source (the embedded default)."""
    tokenizer: str = "bpe:8192"
    """``bpe:VOCAB`` (trained on the corpus), ``bytes``, or a local HF tokenizer folder. Sizes set the vocab
    their parameter counts assume (``bpe:32768`` for the Llama sizes)."""
    text_field: str = "text"
    """Field holding the text in .jsonl/.parquet/HF datasets."""
    extensions: list[str] = field(default_factory=list)
    """File extensions read in folders; empty means the built-in list (txt, md, py, json, ...)."""
    val_fraction: float = 0.005
    """Fraction of documents held out for validation."""
    max_bytes: int | None = None
    """Read at most this many bytes of text from each source (the quickstart reads 6 MB of the stdlib); None
    reads everything. The run plan says how much of the corpus a cap cuts."""
    cache_dir: str | None = None
    """Where token shards are cached; default ``$GPTOUGHTS_CACHE`` or ``~/.cache/gptoughts``."""
    workers: int | None = None
    """Processes that tokenize the corpus (None: one per core this process may use). The shards are
    byte-identical whatever the number (so it is not part of the cache key)."""
    phases: list[PhaseConfig] = field(default_factory=list)
    """Curriculum: ordered phases, each with its sources, weights and token budget."""
    format: Literal["auto", "text", "sft"] = "auto"
    """text (token shards, next-token loss on everything), sft (JSONL of {"prompt","response"} or
    {"messages":[...]}: loss on response tokens only) or auto (sft for .jsonl sources whose first record has
    those keys, else text)."""
    packing: bool = True
    """SFT: pack several examples per row (no attention across them, positions restart per example); false
    puts one example per row, padded."""
    truncation: Literal["right", "drop"] = "right"
    """SFT examples longer than a row: right (keep the first block_size+1 tokens) or drop (skip the example).
    Both are counted and reported."""


@dataclass
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps to run. If none of max_steps/epochs/max_tokens is set, one epoch is run."""
    epochs: float | None = None
    """Passes over the training tokens (fractions allowed)."""
    max_tokens: int | None = None
    """Token budget (global, all ranks)."""
    batch_size: int | str = 8
    """Micro-batch per device in sequences, or ``auto`` (largest that fits)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    global_batch_tokens: int | None = None
    """With ``batch_size = auto``: grad_accum is set so that one step sees about this many tokens."""
    block_size: int = 256
    """Sequence length in tokens (each size sets its own: 2048 for the Llama sizes)."""
    learning_rate: float = 3e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and wsd)."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """cosine (warmup then cosine decay), wsd (warmup-stable-decay) or constant (after warmup)."""
    warmup_steps: int | None = None
    """Linear warmup steps; None (auto) means 2% of the run (at least 1, at most 2000)."""
    decay_fraction: float = 0.2
    """wsd only: fraction of the run spent decaying at the end."""
    weight_decay: float = 0.1
    """AdamW weight decay; never applied to norms, biases and embeddings."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: Muon (momentum orthogonalized by Newton-Schulz, as torch.optim.Muon) for the hidden
    matrices (attention, MLP, experts), AdamW for embeddings, head, norms and biases. LoRA adapters keep AdamW."""
    muon_learning_rate: float | None = None
    """Muon's peak learning rate; None: learning_rate (Muon's update is scaled to AdamW's RMS, 0.2·√max(rows,
    cols), so AdamW's rate carries over). The schedule scales both alike."""
    muon_weight_decay: float | None = None
    """Muon's decoupled weight decay; None: weight_decay."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    optimizer_states: Literal["fp32", "bf16", "8bit"] = "fp32"
    """How AdamW stores its two moments (the weights stay fp32 masters, the update is computed in fp32):
    fp32 (8 bytes/param; torch's fused AdamW), bf16 (4 bytes/param, stored with stochastic rounding; also Muon's
    AdamW groups) or 8bit (~2 bytes/param: torchao's AdamW8bit, block-wise quantized; needs ``pip install
    torchao``; AdamW only, not under FSDP, tensor or pipeline parallelism). A resumed run may name other states than its
    checkpoint's: the moments are converted as they load (to bf16: rounded; to 8bit: quantized). Left unset, bf16
    (8bit where torchao is installed) is chosen where checkpointing alone does not fit the GPU (perf/layout.py)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    seed: int = 1337
    log_interval: int = 10
    """Read losses from the device and log every N steps (the only host-device sync of the loop)."""
    profile: str | None = None
    """``START:END``: record a torch.profiler trace of steps START..END into ``RUN/profile/`` (Perfetto or
    TensorBoard open it)."""


@dataclass
class EvalConfig:
    """``[eval]``: held-out loss, early stopping and generated samples during training."""

    eval_interval: int | None = None
    """Evaluate every N steps (and at the end); 0 disables periodic evaluation; None (auto): about 20 per run,
    at least a minute apart by the plan's time estimate, at most every 1000 steps."""
    eval_batches: int = 20
    """Micro-batches of validation data per evaluation."""
    early_stopping_patience: int | None = None
    """Stop after this many evaluations without val-loss improvement; None disables."""
    early_stopping_min_delta: float = 0.0
    """An evaluation improves on the best when it is lower by more than this."""
    sample_interval: int | None = None
    """Generate samples every N steps; None means at each evaluation; 0 disables."""
    sample_prompts: list[str] = field(default_factory=lambda: ["def fibonacci(n):"])
    """Prompts of the samples (samples.txt, TensorBoard); an empty list disables sampling."""
    sample_max_new_tokens: int = 64
    """Tokens generated per sample."""
    sample_temperature: float = 0.8
    """Sampling temperature (0: greedy)."""
    sample_top_k: int | None = 50
    """Sample among the k most likely tokens; None: all."""
    eval_tasks: list[str] = field(default_factory=list)
    """Tasks scored with the live model during training: task files (JSONL, the formats of ``gptoughts eval
    --tasks``) and lm-evaluation-harness task names (``hellaswag``; needs ``gptoughts[eval]``), logged as
    ``tasks/NAME/METRIC`` to metrics.jsonl, TensorBoard, wandb and ``plots/tasks.png``. Every file, name and
    harness dataset is checked before the run starts. No pipeline parallelism."""
    eval_tasks_interval: int | None = None
    """Score ``eval_tasks`` every N steps (and at the end); None: every ``eval_interval``; 0: only at the end."""
    eval_tasks_limit: int | None = None
    """Score only the first N examples of each of ``eval_tasks`` (a harness task can hold 10,000); None: all."""
    eval_task_dir: str | None = None
    """A folder of lm-evaluation-harness task YAML files for the names in ``eval_tasks`` (``--task_dir`` of
    ``gptoughts eval``)."""


@dataclass
class CheckpointConfig:
    """``[checkpoint]``: when checkpoints are written and how many are kept."""

    save_interval: int | None = None
    """Checkpoint every N steps (and at the end, and on Ctrl-C/SIGTERM); 0 saves only then; None (auto): about
    10 per run, at least ten minutes apart by the plan's time estimate, at most every 2000 steps."""
    keep_last: int = 3
    """Checkpoints kept besides the best one."""
    checkpoints: bool = True
    """Write checkpoints at all (false only for throwaway runs such as benchmarks: nothing can be resumed)."""
    async_save: bool = True
    """Write checkpoints in the background: training goes on once the state is copied to host memory (each rank's
    shards under FSDP; rank 0's whole state in one-process and DDP runs on GPUs); the next save, a rollback and
    the end of the run wait for the write. One-process runs on a CPU, and hosts without the memory for that copy,
    write synchronously."""


@dataclass
class RecoveryConfig:
    """``[recovery]``: what non-finite steps and loss spikes do (README "Instabilities")."""

    nan_policy: Literal["skip", "rollback", "stop", "raise"] = "skip"
    """What a non-finite loss or gradient does (such a step is always skipped on the device: it never changes
    the weights). skip: drop it and go on; after max_bad_steps of them in a row, stop with an error. rollback:
    after max_bad_steps in a row, reload the last checkpoint saved before they began (weights, optimizer, RNG,
    step), multiply the learning rate by rollback_lr_factor, move the data past the bad batches and go on;
    stop with an error after max_rollbacks rollbacks or when no such checkpoint exists. stop (old name: raise):
    stop with an error at the first one (detected at the next log interval). Each error names the last good
    checkpoint. No checkpoint is written while non-finite steps are in a row or when the weights are not
    finite. A collapsed step (loss ln(vocab), a uniform prediction, with a zero gradient) counts as a
    non-finite one. A streak still open at the end of the run is rolled back (rollback) or stops the run with
    the error (skip). A reproducible loss spike (see spike_detection) is dropped (skip), rolled back (rollback)
    or stops the run (stop)."""
    max_bad_steps: int = 20
    """Non-finite steps in a row that make skip stop and rollback roll back (>= 1)."""
    max_rollbacks: int = 3
    """rollback: rollbacks allowed in a run (resumes included) before it stops with an error."""
    rollback_lr_factor: float = 0.5
    """rollback: each rollback multiplies the learning rate by this (in (0, 1])."""
    spike_detection: bool = True
    """Detect loss spikes: a step whose loss is above max(mean + spike_std * std, spike_ratio * mean) of the
    recent steps' losses is held back on the device and re-run once on the same batch from the same state at
    the next log interval: a normal re-run is a transient fault (the re-run is kept), a high one a reproducible
    spike (nan_policy applies). Logged and written to metrics.jsonl as {"event": "spike", "kind": ...}.
    Several processes or fp16: reported only, not re-run."""
    spike_std: float = 6.0
    """Spike threshold in standard deviations above the running mean of the per-step loss (> 0)."""
    spike_ratio: float = 2.0
    """Spike threshold as a multiple of the running mean of the per-step loss (>= 1); both must be exceeded."""
    spike_warmup_steps: int = 100
    """No spike check before this step (the running statistics settle first)."""


@dataclass
class PerfConfig:
    device: str = "auto"
    """auto, cpu, cuda, cuda:N or mps."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto (bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU), fp32, bf16 or fp16."""
    compile: bool | str = "auto"
    """torch.compile the model: true, false or auto (on for CUDA GPUs, off on CPU)."""
    compile_mode: Literal["auto", "blocks", "model"] = "auto"
    """blocks (compile each transformer block: one graph reused, fast to compile), model (the whole model as one
    graph for training: +2-6% steady tokens/s at 47M-125m on the user's path, ~20 s more compile; evaluations and
    the auto-batch probe still run the per-block graphs) or auto (model for llama and gpt2 up to 400M
    non-embedding parameters in one process, for runs estimated at 20 minutes or more; blocks otherwise)."""
    cuda_graphs: bool | str = "auto"
    """Replay the compiled training graphs as CUDA graphs (torch.compile mode reduce-overhead): no kernel-launch
    gaps, more memory (gradients stay allocated between steps). auto: on for LoRA (not QLoRA) on a Llama base,
    compiled, in one CUDA process, not in fp16, at a given batch size (short steps of many small kernels: +6% at 1b without adapter
    dropout, +7-20% with it), off otherwise:
    it gained nothing on pretraining's path, whose auto batch is large (47M, 125m: +0.2%, -0.7%), and at the 47M
    shape's fixed 32 x 512 batch it is slower than the whole model without it (0.86x; bench/BENCHMARKS.md)."""
    max_autotune: bool = False
    """Inductor benchmarks Triton matmul templates against cuBLAS and fuses epilogues (compile takes minutes)."""
    residual_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """dtype of the residual stream (the activations between blocks) under bf16 mixed precision: fp32, bf16
    (the embedding output is cast to bf16, so every block reads and writes bf16 activations and gradients, as
    with bf16 parameters in torchtitan/FSDP and Megatron's default; norms still compute in fp32), or auto (bf16
    on GPUs with bf16: +6% tokens/s at 125m, +1% at 1b, less memory; fp32 elsewhere). Only acts under bf16."""
    fp8: bool | str = False
    """FP8 matmuls through torchao float8 (Ada/Hopper+): true, false or auto (on for Hopper+ at d_model >= 2048)."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """tensorwise (one scale per tensor, fastest) or rowwise (one scale per row, more robust)."""
    fp8_bf16_end_layers: int = 0
    """With fp8: keep the first and the last this-many transformer blocks in bf16 (closer loss, less speed)."""
    fp8_fast_accum: bool = False
    """With fp8: the backward's matmuls (input and weight gradients) also accumulate in the tensor cores' fast,
    lower-precision mode, as the forward's already do (torchao's default keeps them precise). 3b on an H100:
    1.23-1.24x bf16 instead of 1.19-1.21x (tensorwise; rowwise not measured); 300-step losses of 3 runs no
    worse than bf16's, but nothing longer was checked, hence off by default (bench/BENCHMARKS.md)."""
    gpu_memory_gib: float | None = None
    """Use at most this much of the GPU's memory (``torch.cuda.set_per_process_memory_fraction``); the plan, the
    estimate and ``--batch_size auto`` see a GPU of this size. To rehearse a run meant for a smaller GPU, or to
    share one. None: all of it."""
    ignore_memory_estimate: bool = False
    """Start a run whose estimated peak memory exceeds the device's (on a CPU: the memory available now) by more
    than the estimate's error; by default such a run is refused before anything is built, since it would end
    out of memory (on a CPU, killed by the kernel without a word)."""
    fp8_all_gather: bool = False
    """With fp8 tensorwise under FSDP2: all-gather the weights in fp8 (half the bytes of bf16), their scales
    computed for all weights at once after each optimizer step (torchao's FSDP float8 all-gather). No effect
    without FSDP."""
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "auto"
    """none, selective (recompute cheap ops, keep matmul outputs), full (recompute whole blocks) or auto (selective
    for LoRA: 19% less memory for 2-5% of the speed at 1b; none otherwise)."""
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math", "fa4"] = "auto"
    """Attention kernel: fa4: FlashAttention-4 (pip install flash-attn-4; Hopper/Blackwell GPUs) for causal and
    bidirectional attention and sliding windows in bf16/fp16, SDPA for the rest (KV-cache decoding, fp32);
    flash, cudnn, efficient or math (SDPA restricted to that kernel); auto: fa4 where flash-attn-4 is installed
    and runs (measured 1.09-1.18x SDPA's fastest kernel on an H100), else SDPA's own pick. ``gptoughts env``
    lists what this machine has; bench/attention.py times each one."""
    doc_mask_attention: Literal["auto", "flex", "sdpa"] = "auto"
    """Attention of packed rows (documents packed into one row, e.g. SFT packing: no attention across them):
    flex (FlexAttention with a block mask of the documents: blocks outside them are skipped and k/v heads are
    shared; CUDA only; 4.2x the dense mask's attention speed on an H100, but a 350m SFT run failed in its first
    evaluation with an illegal memory access on torch 2.11: experimental), sdpa (a dense [B, 1, T, T] mask and
    SDPA's memory-efficient kernel) or auto (sdpa, until flex runs a whole training run)."""
    loss: Literal["auto", "plain", "chunked", "liger"] = "auto"
    """LM-head cross-entropy: auto, plain, chunked (no full fp32 logits) or liger (Liger-Kernel, if installed)."""
    loss_chunk: int = 4096
    """Rows per chunk for the chunked loss."""
    tf32: bool = True
    """Allow TF32 matmuls for any fp32 work left on Ampere+ GPUs."""
    fused_adamw: bool | str = "auto"
    """Use the fused CUDA AdamW (auto: on CUDA)."""
    expandable_segments: bool = True
    """CUDA allocator with expandable segments: less fragmentation when batch shapes vary (eval vs train)."""
    threads: int | None = None
    """CPU threads for torch on a CPU run; None (auto): ``OMP_NUM_THREADS`` when set, a resumed run's own count,
    else the faster of one thread and every core on a short forward+backward of the model (one thread wins on a
    busy machine, every core on an idle one). Losses reproduce bit for bit at the same count only: the plan says
    it, run.json records it."""


@dataclass
class ParallelConfig:
    strategy: Literal["auto", "ddp", "fsdp", "none"] = "auto"
    """auto (ddp when launched by torchrun with several processes), ddp, fsdp (FSDP2: parameters, gradients and
    optimizer state sharded across the ranks; for models whose training state does not fit one GPU), or none."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    tp: int = 1
    """Tensor-parallel degree: each transformer block's matrices are split over ``tp`` ranks (DTensor, with
    sequence parallelism for the norms); the ranks of a tensor-parallel group read the same data. The world
    size must be a multiple of ``tp * pp``; the rest is data-parallel (``strategy``)."""
    pp: int = 1
    """Pipeline-parallel degree: the blocks are split into ``pp`` stages by layers, one per rank of a
    pipeline group, micro-batches flow through them (torch.distributed.pipelining)."""
    pp_schedule: Literal["1f1b", "interleaved"] = "1f1b"
    """Pipeline schedule: 1f1b (one stage per rank) or interleaved (interleaved 1F1B: two stages per rank,
    a smaller bubble)."""
    pp_microbatches: int = 0
    """Micro-batches of one pipeline step: the optimizer step's rows (``batch_size x grad_accum``) are split into
    this many, which flow through the stages in one schedule step (a divisor of the rows, >= ``pp``; a multiple
    of ``pp`` for interleaved); 0: auto (the most that divide the rows, up to 2 x ``pp``)."""
    pp_layers: list[int] = field(default_factory=list)
    """Layers per stage, overriding the even split (e.g. ``[9, 7]`` for 16 layers on 2 stages: the last
    stage also holds the head); empty: as even as the layers allow, the head counting as one layer."""
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state in CPU memory between uses (FSDP2 CPUOffloadPolicy; the
    optimizer steps on the CPU). Fits models several times larger than the GPU, slower; also on one GPU. Left
    unset, a one-process run turns it on where nothing else fits the GPU and the host memory holds the states
    (perf/layout.py)."""
    reshard_after_forward: bool | str = "auto"
    """FSDP2: true frees each block's gathered weights after its forward and gathers them again for its backward
    (the last block is always kept); false keeps them until the backward: one all-gather per block and step
    fewer, for the whole model's bf16 weights on every GPU (ZeRO-2's memory). auto: false when the memory
    estimate with every block kept stays under 80% of the GPU, else true. Measured on 2 x H200 (bench/
    BENCHMARKS.md): false gives 1b 97.1% per-GPU scaling (95.4% with true), 8b 1.026x tokens/s."""
    ddp_bucket_mb: int = 0
    """DDP: size in MB of the gradient buckets all-reduced while the backward runs. 0 (auto): a twentieth of the
    model's gradients, between 25 MB (torch's default) and 250 MB: 1b with 200 MB buckets scaled 95.1% per GPU on
    2 x H200 against 90.6% with 25 MB (bench/BENCHMARKS.md); fewer, larger all-reduces cost less launch and
    latency, and twenty still overlap the backward."""


@dataclass
class RunConfig:
    out: str | None = None
    """Run directory: config.toml, run.json, metrics.jsonl, plots/, tensorboard/, samples.txt, checkpoints/.
    None (auto): ``runs/FAMILY-SIZE`` (the quickstart: ``runs/quickstart``)."""
    overwrite: bool = False
    """Replace a run dir that holds a different run."""
    resume: str | None = None
    """auto (newest valid checkpoint of ``out``) or a checkpoint path."""
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "gptoughts"
    progress: bool = True
    """Show a rich progress bar (rank 0, on a terminal)."""


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train low-rank adapters (PEFT LoRA) instead of every weight; needs ``model.init_from``."""
    r: int = 16
    """Rank of the adapters."""
    alpha: float = 32.0
    """Scale: the update is ``alpha / r * B @ A``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0, PEFT's default, allows the merged forward below; 0.05-0.1 is common
    for small data sets: the adapter then runs beside the base matmul, ~13% slower at 1b). Our layer (below)
    draws the mask from a seed taken from torch's generator (gptoughts/perf/dropout.py): the rate is this value
    to within 1/131072; with ``merged_forward false`` or QLoRA, PEFT's dropout module draws it."""
    target_modules: list[str] = field(default_factory=list)
    """Module names to adapt (suffixes, e.g. ``wq,wv`` natively or ``q_proj,v_proj`` on transformers models);
    empty means every linear layer of the transformer blocks (attention and MLP projections)."""
    quantize: Literal["none", "4bit"] = "none"
    """none, or 4bit (QLoRA: NF4 base weights through bitsandbytes; CUDA only)."""
    base_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """dtype of the frozen base weights: auto (bf16 when training in bf16, else fp32), fp32, bf16 or fp16.
    A frozen weight needs no fp32 master copy, gradient or optimizer state: bf16 halves its memory."""
    merged_forward: bool = True
    """Fold each adapter into its frozen weight (``W + alpha/r * B @ A``) for the step instead of running it
    beside the base matmul: same result, one matmul per layer (gptoughts/perf/lora.py). Applies when the
    adapter input has no dropout (or in eval), the base is not 4-bit and the call has enough tokens to pay for
    the fold (training batches, not decoding). With adapter dropout in training, the adapter's product is added
    into the base's output instead, and the dropout mask is drawn as bits and kept for the backward (1b, CUDA
    graphs: 1.07x the speed of PEFT's layer at 0.62x its peak memory). false keeps PEFT's own forward."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    resolved: dict[str, str] = field(default_factory=dict)
    """Settings the run did not give that were decided from outside the config files (a fine-tuning run's block
    from its model's positions; the memory layout, ``perf/layout.py``), each with why, for the run plan; not a
    section of config.toml."""
    given: frozenset[str] | None = field(default=None, compare=False, repr=False)
    """The dotted keys the user set: the preset or TOML file named (a resumed run's config.toml) and the flags; not
    the family's size defaults (``presets/sizes.toml``) nor the dataclass defaults. Automatic choices leave them
    alone (:meth:`is_given`). None: a Config built in code. Where a value came from, not part of it (not
    compared)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("resolved")
        d.pop("given")
        overrides = d["model"].pop("overrides")
        d["model"].update(overrides)
        return d

    def is_given(self, key: str) -> bool:
        """Whether the user set the dotted ``key``: named in :attr:`given`; in a Config built in code, a value other
        than the dataclass default."""
        if self.given is not None:
            return key in self.given
        section, name = key.split(".")
        return getattr(getattr(self, section), name) != getattr(SECTIONS[section](), name)


# ------------------------------------------------------------------------------------------ self-description

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "recovery": RecoveryConfig,
    "perf": PerfConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
    "lora": LoraConfig,
}
# Keys that moved out of [train] (it held 42 fields) into sections of their own: the old dotted spellings and
# old TOML files keep working.
MOVED: dict[str, str] = {
    f"train.{f.name}": f"{sec}.{f.name}"
    for sec, cls in (("eval", EvalConfig), ("checkpoint", CheckpointConfig), ("recovery", RecoveryConfig))
    for f in dataclasses.fields(cls)
}


def _migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Move the keys of an old ``[train]`` table to their sections (a TOML file written before the split)."""
    train = data.get("train")
    if isinstance(train, dict):
        for key in [k for k in train if f"train.{k}" in MOVED]:
            section = MOVED[f"train.{key}"].split(".")[0]
            data.setdefault(section, {}).setdefault(key, train.pop(key))
    return data


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (what ``--help`` prints)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen app): no help text, not an error
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _pretty_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "|".join(map(str, typing.get_args(tp)))
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        text = " or ".join(_pretty_type(a) for a in args if a is not type(None))
        return text + (" or none" if type(None) in args else "")
    if origin is list:
        (item,) = typing.get_args(tp)
        return "list of TOML tables" if dataclasses.is_dataclass(item) else f"{_pretty_type(item)},..."
    return getattr(tp, "__name__", str(tp))


def describe_fields(sections: tuple[str, ...] = tuple(SECTIONS)) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every field of ``sections``, in declaration order."""
    rows = []
    for name in sections:
        cls = SECTIONS[name]
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "overrides":
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            else:
                default = None
            rows.append(
                (
                    f"{name}.{f.name}",
                    _pretty_type(hints[f.name]),
                    json.dumps(default) if not isinstance(default, str) else default,
                    docs.get(f.name, ""),
                )
            )
    return rows


# --------------------------------------------------------------------------------------------- validation

_MODEL_FIXED = {f.name for f in dataclasses.fields(ModelConfig)} - {"overrides"}


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from nested dicts (the parsed TOML)."""
    return build_dataclass(Config, _migrate(data), "")


def _deep_update(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


SIZES_FILE = PRESET_DIR / "sizes.toml"
# Any of these makes a run "named": it starts from the defaults of the family and size asked, not from the
# quickstart preset (which only a bare `gptoughts train` trains).
NAMING_KEYS = ("data.sources", "model.family", "model.size", "model.init_from")
# Stopping rules: the one the user gives wins over a preset's; two given together are a conflict.
STOP_KEYS = ("train.max_steps", "train.epochs", "train.max_tokens")
# Keys holding paths: relative ones in a TOML file are resolved against that file's folder.
_PATH_KEYS = (
    ("data", "sources"),
    ("data", "cache_dir"),
    ("model", "init_from"),
    ("eval", "eval_tasks"),
    ("eval", "eval_task_dir"),
)


def is_task_file(spec: str) -> bool:
    """An entry of ``eval_tasks`` / ``eval --tasks`` naming a task file (JSONL) rather than lm-evaluation-harness
    task names (``hellaswag,arc_easy``)."""
    return spec.endswith(".jsonl") or "/" in spec or os.sep in spec or Path(spec).is_file()


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml") if p != SIZES_FILE)


def _resolve_paths(data: dict[str, Any], folder: Path) -> None:
    """Relative paths of a user's TOML file are relative to the file, not to the current directory."""

    def fix(value: Any) -> Any:
        if isinstance(value, str) and value and not value.startswith("@") and not Path(value).is_absolute():
            return str((folder / value).resolve())
        return value

    for section, key in _PATH_KEYS:
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            value = table[key]
            if key == "eval_tasks":  # harness task names stay names
                table[key] = [fix(v) if isinstance(v, str) and is_task_file(v) else v for v in value]
            elif key == "init_from" and _names_a_hub_model(value, folder):
                continue
            else:
                table[key] = [fix(v) for v in value] if isinstance(value, list) else fix(value)
    tok = data.get("data", {}).get("tokenizer") if isinstance(data.get("data"), dict) else None
    if isinstance(tok, str) and not tok.startswith(("bpe:", "bytes")) and (folder / tok).exists():
        data["data"]["tokenizer"] = str((folder / tok).resolve())
    phases = data.get("data", {}).get("phases") if isinstance(data.get("data"), dict) else None
    for phase in phases if isinstance(phases, list) else []:
        if isinstance(phase, dict) and isinstance(phase.get("sources"), list):
            phase["sources"] = [fix(v) for v in phase["sources"]]


def _names_a_hub_model(value: Any, folder: Path) -> bool:
    """``ORG/NAME`` with no such folder beside the file: a Hugging Face hub id, not a relative path."""
    from gptoughts.models.hf import is_hub_id

    return isinstance(value, str) and is_hub_id(value) and not (folder / value).exists()


def _preset_path(name_or_path: str | Path) -> tuple[Path, bool]:
    """(path, is a user file) of a preset name or a TOML path."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" and path.is_file():
        return path.resolve(), path.resolve().parent != PRESET_DIR.resolve()
    candidate = PRESET_DIR / f"{name_or_path}.toml"
    if candidate.is_file() and candidate != SIZES_FILE:
        return candidate, False
    if str(name_or_path).endswith(".toml"):
        raise ConfigError(
            f"config file {name_or_path} does not exist; pass a preset name or an existing .toml"
        )
    raise ConfigError(f"unknown preset `{name_or_path}`{did_you_mean(str(name_or_path), list_presets())}")


def read_toml(name_or_path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a preset by name or a TOML file by path, following ``base = "other"`` chains (a relative ``base``
    path is relative to the file that names it; a chain that comes back to a file is an error)."""
    path, user_file = _preset_path(name_or_path)
    if path in _chain:
        loop = " -> ".join(p.name for p in (*_chain, path))
        raise ConfigError(f"{_chain[0]}: `base` chain loops back ({loop}); remove the loop")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if user_file:
        _resolve_paths(data, path.parent)
    _migrate(data)
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: `base` must be a preset name or a .toml path, got {base!r}")
        ref = base
        if base.endswith(".toml") and not Path(base).expanduser().is_absolute():
            ref = str(path.parent / base)
        data = _deep_update(read_toml(ref, (*_chain, path)), data)
    return data


def size_defaults(family: str, size: str) -> dict[str, Any]:
    """The training defaults of ``family``/``size`` (``presets/sizes.toml``) as nested dicts ({} if none); a
    variant (``qwen2``: a Llama with q/k/v biases) trains with its family's."""
    from gptoughts.models import resolve_variant

    family = resolve_variant(family)[0]
    table = tomllib.loads(SIZES_FILE.read_text(encoding="utf-8")).get(family, {}).get(str(size).lower(), {})
    out: dict[str, Any] = {}
    for key, value in table.items():
        set_dotted(out, MOVED.get(key, key), value)
    return out


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Apply ``a.b.c = value`` to nested dicts (validation happens later, in :func:`from_dict`)."""
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"`{key}`: `{p}` is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def starting_preset(preset: str | Path | None, overrides: dict[str, Any]) -> str | Path:
    """Where a run starts: the preset it names; else the quickstart for a bare run; else ``default``."""
    if preset is not None:
        return preset
    return "default" if any(k in overrides for k in NAMING_KEYS) else DEFAULT_PRESET


def _run_config_file(data: dict[str, Any], overrides: dict[str, Any]) -> Path | None:
    """With ``run.resume = auto``: the ``config.toml`` of the run being resumed (None when there is none yet)."""
    resume = overrides.get("run.resume", data.get("run", {}).get("resume"))
    if resume != "auto":  # (--resume PATH starts a run from that checkpoint with the config given)
        return None
    out = overrides.get("run.out", data.get("run", {}).get("out"))
    if out is None:
        out = default_out(data, overrides)
    f = Path(str(out)).expanduser() / "config.toml"
    return f if f.is_file() else None


def _read_run_config(run_file: Path) -> dict[str, Any]:
    """The tables of a run's ``config.toml``. A run writes every section: one without ``[model]`` or ``[data]``
    (an emptied file) is refused by name, rather than resumed as the defaults with no data."""
    try:
        data = _migrate(tomllib.loads(run_file.read_text(encoding="utf-8")))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{run_file} is corrupt ({str(e).splitlines()[0]}); restore it, or start a new run with another --out"
        ) from None
    missing = [t for t in ("model", "data") if not isinstance(data.get(t), dict)]
    if missing:
        what = "is empty" if not data else f"has no [{'] or ['.join(missing)}] table"
        raise ConfigError(
            f"{run_file} {what}, so it is not the config the run was started with (a run writes every section); "
            "restore it from a copy, or start over with --overwrite"
        )
    return data


def default_out(data: dict[str, Any], overrides: dict[str, Any]) -> str:
    model = data.get("model", {})
    family = overrides.get("model.family", model.get("family", ModelConfig.family))
    size = overrides.get("model.size", model.get("size", ModelConfig.size))
    if overrides.get("model.init_from") or model.get("init_from"):
        src = Path(str(overrides.get("model.init_from") or model.get("init_from"))).name or "model"
        return f"runs/{src}-finetune"
    return f"runs/{family}-{size}"


def load_config(preset: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """The config of a run, composed in one order (README "Where a run starts"):

    1. the dataclass defaults;
    2. the training defaults of the run's family and size (``presets/sizes.toml``);
    3. the preset or TOML file named (none named: the quickstart for a bare run, else ``default``);
       with ``run.resume``, the resumed run's own ``config.toml`` instead of 2 and 3;
    4. the dotted ``overrides`` (the command line's flags).

    A preset's architecture fields are dropped when the overrides change its family or size; a stopping rule
    given in the overrides replaces the preset's; two stopping rules given together are an error.
    """
    overrides = {MOVED.get(k, k): v for k, v in (overrides or {}).items()}
    top = list(SECTIONS)
    for key in overrides:
        section = key.split(".")[0]
        if section not in top:
            raise ConfigError(
                f"unknown config key `{key}`: sections are {', '.join(top)}{did_you_mean(section, top)}"
            )
    given_stops = [k for k in STOP_KEYS if overrides.get(k) is not None]
    if len(given_stops) > 1:
        flags = " and ".join(f"--{k.split('.')[1]}" for k in given_stops)
        raise ConfigError(f"{flags} are two stopping rules; give one (steps, epochs or a token budget)")
    data = read_toml(starting_preset(preset, overrides))
    run_file = _run_config_file(data, overrides)
    if run_file is not None:
        # (a preset named beside --resume is where the run started: its config.toml already holds it all)
        data = _read_run_config(run_file)
        data.setdefault("run", {})["out"] = str(run_file.parent)
        # How a run is launched is not part of it: a run saved under FSDP on 2 GPUs resumes on one.
        data.pop("parallel", None)
        given = dotted_keys(data)  # (a resumed run's config.toml holds every value its first start decided)
    else:
        preset_model = data.get("model", {})
        family = overrides.get("model.family", preset_model.get("family", ModelConfig.family))
        size = overrides.get("model.size", preset_model.get("size", ModelConfig.size))
        if (family, size) != (
            preset_model.get("family", ModelConfig.family),
            preset_model.get("size", ModelConfig.size),
        ):
            # The preset's architecture fields describe its own shape (the quickstart's d_model, n_kv_heads, ...):
            # another family or size starts from its size preset, not from them.
            data["model"] = {k: v for k, v in preset_model.items() if k in _MODEL_FIXED}
        given = dotted_keys(data)  # the preset's or file's: the size's defaults below are not the user's
        if isinstance(family, str) and isinstance(size, str):
            data = _deep_update(size_defaults(family, size), data)
    if given_stops:
        for key in STOP_KEYS:
            data.get("train", {}).pop(key.split(".")[1], None)
        given -= set(STOP_KEYS)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    cfg = from_dict(data)
    cfg.given = frozenset(given | set(overrides))
    if cfg.run.out is None:
        cfg.run.out = default_out(data, {})
    validate(cfg)
    if cfg.model.init_from is not None:
        finetune_defaults(cfg)
    return cfg


def dotted_keys(data: dict[str, Any]) -> set[str]:
    """The ``section.key`` names a TOML table's sections set."""
    return {f"{sec}.{k}" for sec, table in data.items() if isinstance(table, dict) for k in table}


# The block and peak learning rate of a fine-tuning run that gives none. The block is the model's positions up to
# this; the rate depends on the method: full fine-tuning stays close to the pretrained weights, LoRA's adapters
# start from zero and want about 10x more (the rates of PEFT's and the Llama recipes' examples).
FINETUNE_BLOCK_SIZE = 1024
FINETUNE_LEARNING_RATE = {"full": 2e-5, "lora": 2e-4}


def finetune_defaults(cfg: Config) -> None:
    """Set the block and the learning rate where the user did not (:meth:`Config.is_given`), and say why in
    ``cfg.resolved``."""
    t = cfg.train
    if not cfg.is_given("train.learning_rate"):
        method, other = ("lora", "full") if cfg.lora.enabled else ("full", "lora")
        t.learning_rate = FINETUNE_LEARNING_RATE[method]
        names = {"lora": "LoRA's", "full": "full fine-tuning's"}
        cfg.resolved["learning_rate"] = (
            f"{names[method]} default; {names[other]} is {FINETUNE_LEARNING_RATE[other]:g}"
        )
    if not cfg.is_given("train.block_size"):
        from gptoughts.models.hf import locate, max_positions

        positions = max_positions(locate(cfg.model.init_from, weights=False))
        t.block_size = min(FINETUNE_BLOCK_SIZE, positions or FINETUNE_BLOCK_SIZE)
        cfg.resolved["block_size"] = (
            f"the model's {positions:,} positions; finetune's default is {FINETUNE_BLOCK_SIZE:,}"
            if positions and positions < FINETUNE_BLOCK_SIZE
            else f"finetune's default; the model has {positions:,} positions"
            if positions
            else "finetune's default"
        )


def validate(cfg: Config) -> None:
    """Cross-field checks and the family-specific ``[model]`` keys."""
    from gptoughts import models

    _validate_finetune(cfg)  # conflicts of the config itself, before a model is looked up (or downloaded)
    if cfg.model.init_from is not None:
        # Fine-tuning: the model's config (a hub id's from the Hugging Face cache) says which family it is, and
        # `model.*` overrides are checked against that family (fields that change no parameter are allowed; the
        # load checks the shapes).
        from gptoughts.models.hf import find_adapter, locate, read_config

        config = read_config(locate(cfg.model.init_from, weights=False))
        found = find_adapter(str(config["model_type"]))
        if found is None and cfg.model.overrides:
            raise ConfigError(
                f"model.{next(iter(cfg.model.overrides))}: {cfg.model.init_from} has no native "
                "implementation here (it trains through transformers), so its config cannot be "
                "overridden; drop the override"
            )
        if found is not None:
            cfg.model.family = found[0]
    # `--model qwen2` is the llama family with its switch: the run is built, saved and resumed as that
    cfg.model.family, cfg.model.overrides = models.resolve_variant(cfg.model.family, cfg.model.overrides)
    hints = typing.get_type_hints(models.get_family(cfg.model.family).args_cls)
    for key, value in cfg.model.overrides.items():  # "8" from the command line -> 8, as the family declares
        if isinstance(value, str) and key in hints:
            cfg.model.overrides[key] = coerce(value, hints[key], f"model.{key}")
    models.model_args(cfg.model.family, cfg.model.size, cfg.model.overrides)
    t = cfg.train
    if isinstance(t.batch_size, str) and t.batch_size != "auto":
        raise ConfigError(f"train.batch_size must be a positive integer or auto, got {t.batch_size!r}")
    for name in ("grad_accum", "block_size"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(t, name)}")
    if isinstance(t.batch_size, int) and t.batch_size < 1:
        raise ConfigError(f"train.batch_size must be >= 1, got {t.batch_size}")
    check_train_ranges(t, cfg.eval, cfg.checkpoint, cfg.recovery)
    if t.optimizer_states == "8bit" and t.optimizer == "muon":
        raise ConfigError(
            "train.optimizer_states = 8bit is AdamW's (torchao AdamW8bit); with train.optimizer = muon use "
            "--train.optimizer_states bf16"
        )
    check_parallel(cfg.parallel)
    for name in ("compile", "cuda_graphs", "fp8", "fused_adamw"):
        value = getattr(cfg.perf, name)
        if isinstance(value, str) and value != "auto":
            raise ConfigError(f"perf.{name} must be true, false or auto; got {value!r}")
    if cfg.perf.threads is not None and cfg.perf.threads < 1:
        raise ConfigError(
            f"perf.threads must be >= 1, got {cfg.perf.threads}; leave it out to measure the count (--threads N)"
        )
    if cfg.perf.gpu_memory_gib is not None and not cfg.perf.gpu_memory_gib > 0:
        raise ConfigError(f"perf.gpu_memory_gib must be > 0 GiB, got {cfg.perf.gpu_memory_gib}")
    if cfg.perf.fp8_bf16_end_layers < 0:
        raise ConfigError(f"perf.fp8_bf16_end_layers must be >= 0, got {cfg.perf.fp8_bf16_end_layers}")
    if cfg.perf.residual_dtype == "bf16" and cfg.perf.precision not in ("auto", "bf16"):
        raise ConfigError(
            f"perf.residual_dtype = bf16 needs bf16 mixed precision, but perf.precision is "
            f"{cfg.perf.precision}; use --precision bf16 or perf.residual_dtype = fp32"
        )
    if t.profile is not None:
        start, sep, end = t.profile.partition(":")
        if not (sep and start.isdigit() and end.isdigit() and int(start) < int(end)):
            raise ConfigError(
                f"train.profile must be START:END steps with START < END (e.g. 10:15); got {t.profile!r}"
            )
    _validate_eval_tasks(cfg)
    for p in cfg.data.phases:
        if p.weights and len(p.weights) != len(p.sources):
            raise ConfigError(
                f"data.phases `{p.name}`: {len(p.weights)} weights for {len(p.sources)} sources"
            )


# The longest sequence any size here is built for is 8192; 1M positions already need GBs of RoPE tables. A
# larger block_size is a typo, refused before a model is built or a corpus read.
MAX_BLOCK_SIZE = 1 << 20


def check_train_ranges(
    t: TrainConfig,
    ev: EvalConfig | None = None,
    ck: CheckpointConfig | None = None,
    rc: RecoveryConfig | None = None,
) -> None:
    """The numeric ranges of ``[train]``, ``[eval]``, ``[checkpoint]`` and ``[recovery]`` (the trainer checks them
    again when it is built directly)."""
    ev, ck, rc = ev or EvalConfig(), ck or CheckpointConfig(), rc or RecoveryConfig()
    if not math.isfinite(t.learning_rate) or t.learning_rate <= 0:
        raise ConfigError(f"train.learning_rate must be a finite number > 0, got {t.learning_rate}")
    if t.block_size > MAX_BLOCK_SIZE:
        raise ConfigError(
            f"train.block_size = {t.block_size:,} is beyond what a model here can be built for "
            f"({MAX_BLOCK_SIZE:,} positions); use the sequence length you train at, e.g. 2048"
        )
    for name in ("max_steps", "epochs", "max_tokens"):
        value = getattr(t, name)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ConfigError(f"train.{name} must be > 0 (got {value}): it would train nothing")
    sections = (("train", t), ("eval", ev), ("checkpoint", ck), ("recovery", rc))
    for sec, name in (("train", "log_interval"), ("eval", "eval_batches"), ("recovery", "max_bad_steps")):
        if getattr(dict(sections)[sec], name) < 1:
            raise ConfigError(f"{sec}.{name} must be >= 1, got {getattr(dict(sections)[sec], name)}")
    for sec, name in (
        ("eval", "eval_interval"),
        ("checkpoint", "save_interval"),
        ("eval", "sample_interval"),
        ("checkpoint", "keep_last"),
        ("train", "warmup_steps"),
        ("eval", "early_stopping_patience"),
        ("recovery", "max_rollbacks"),
        ("recovery", "spike_warmup_steps"),
        ("eval", "sample_max_new_tokens"),
        ("eval", "eval_tasks_interval"),
    ):
        value = getattr(dict(sections)[sec], name)
        if value is not None and value < 0:
            raise ConfigError(f"{sec}.{name} must be >= 0, got {value}")
    if t.global_batch_tokens is not None and t.global_batch_tokens < 1:
        raise ConfigError(f"train.global_batch_tokens must be >= 1, got {t.global_batch_tokens}")
    if ev.eval_tasks_limit is not None and ev.eval_tasks_limit < 1:
        raise ConfigError(
            f"eval.eval_tasks_limit must be >= 1 (None: all examples), got {ev.eval_tasks_limit}"
        )
    for where, ok, rule, value in (
        (
            "recovery.rollback_lr_factor",
            0.0 < rc.rollback_lr_factor <= 1.0,
            "in (0, 1]",
            rc.rollback_lr_factor,
        ),
        ("recovery.spike_std", rc.spike_std > 0, "> 0", rc.spike_std),
        ("recovery.spike_ratio", rc.spike_ratio >= 1.0, ">= 1", rc.spike_ratio),
        ("train.min_lr_ratio", 0.0 <= t.min_lr_ratio <= 1.0, "in [0, 1]", t.min_lr_ratio),
        ("train.decay_fraction", 0.0 <= t.decay_fraction <= 1.0, "in [0, 1]", t.decay_fraction),
        ("train.grad_clip", t.grad_clip >= 0 and math.isfinite(t.grad_clip), ">= 0", t.grad_clip),
        ("train.muon_momentum", 0.0 <= t.muon_momentum < 1.0, "in [0, 1)", t.muon_momentum),
        (
            "train.muon_learning_rate",
            t.muon_learning_rate is None
            or (math.isfinite(t.muon_learning_rate) and t.muon_learning_rate > 0),
            "a finite number > 0",
            t.muon_learning_rate,
        ),
        (
            "train.muon_weight_decay",
            t.muon_weight_decay is None or t.muon_weight_decay >= 0,
            ">= 0",
            t.muon_weight_decay,
        ),
    ):
        if not ok:
            raise ConfigError(f"{where} must be {rule}, got {value}")


def check_parallel(p: ParallelConfig) -> None:
    """The ranges of ``[parallel]`` (the world size is checked against them when the process group starts)."""
    for name in ("tp", "pp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    if isinstance(p.reshard_after_forward, str) and p.reshard_after_forward != "auto":
        raise ConfigError(
            f"parallel.reshard_after_forward must be true, false or auto; got {p.reshard_after_forward!r}"
        )
    if p.ddp_bucket_mb < 0:
        raise ConfigError(f"parallel.ddp_bucket_mb must be >= 0 (MB; 0: auto), got {p.ddp_bucket_mb}")
    if p.pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches must be >= 0 (0: auto), got {p.pp_microbatches}")
    if p.pp_layers and (len(p.pp_layers) != p.pp * (2 if p.pp_schedule == "interleaved" else 1)):
        raise ConfigError(
            f"parallel.pp_layers has {len(p.pp_layers)} entries; it needs one per stage "
            f"({p.pp} with --parallel.pp {p.pp}{', x2 for interleaved' if p.pp_schedule == 'interleaved' else ''})"
        )
    if any(n < 1 for n in p.pp_layers):
        raise ConfigError(f"parallel.pp_layers entries must be >= 1, got {p.pp_layers}")
    if p.tp > 1 and p.pp > 1:
        raise ConfigError(
            "parallel.tp and parallel.pp do not combine yet: use one of them (with FSDP over the rest)"
        )
    if p.strategy == "none" and (p.tp > 1 or p.pp > 1):
        raise ConfigError(
            "parallel.strategy = none runs one process; tensor/pipeline parallelism needs torchrun"
        )


def _validate_eval_tasks(cfg: Config) -> None:
    """What periodic task evaluation cannot run on yet (the files themselves are read when the run starts)."""

    if not cfg.eval.eval_tasks:
        return
    if cfg.parallel.pp > 1:
        raise ConfigError(
            "eval.eval_tasks does not run under pipeline parallelism (no rank holds the whole model); drop "
            "--eval_tasks and score the run afterwards with gptoughts eval RUN --tasks FILE.jsonl"
        )


def _validate_finetune(cfg: Config) -> None:
    lo = cfg.lora
    if lo.r < 1:
        raise ConfigError(f"lora.r must be >= 1, got {lo.r}")
    if lo.alpha <= 0:
        raise ConfigError(f"lora.alpha must be > 0, got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lo.dropout}")
    if lo.enabled and (cfg.parallel.strategy == "fsdp" or cfg.parallel.cpu_offload):
        raise ConfigError(
            "LoRA runs are data-parallel with DDP (parallel.strategy = auto or ddp): the frozen base "
            "is not sharded by this version's FSDP path"
        )
    if lo.quantize != "none" and not lo.enabled:
        raise ConfigError("lora.quantize needs LoRA: add --lora (QLoRA trains adapters over a 4-bit base)")
    if cfg.model.init_from is None and lo.enabled:
        raise ConfigError("LoRA adapts a pretrained model: pass --model HF_DIR (model.init_from) with --lora")


# ----------------------------------------------------------------------------------------------- TOML out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return (
            "{"
            + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None)
            + "}"
        )
    raise TypeError(f"cannot write {v!r} to TOML")


def to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML (None values are omitted: they are the defaults)."""
    out: list[str] = [
        "# Fully resolved gptoughts config (written by the run; edit a copy to start a new one)."
    ]
    for section, values in cfg.to_dict().items():
        out.append(f"\n[{section}]")
        tables = []
        for k, v in values.items():
            if v is None:
                continue
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                tables.append((k, v))
                continue
            out.append(f"{k} = {_toml_value(v)}")
        for k, rows in tables:
            for row in rows:
                out.append(f"\n[[{section}.{k}]]")
                out.extend(f"{rk} = {_toml_value(rv)}" for rk, rv in row.items() if rv is not None)
    return "\n".join(out) + "\n"


def config_from_toml_text(text: str) -> Config:
    return from_dict(tomllib.loads(text))
