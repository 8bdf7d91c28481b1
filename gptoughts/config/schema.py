"""The typed configuration tree: one dataclass per section of a run, each field documented where it is declared.

A run is described by one :class:`Config`: sections ``model``, ``data``, ``train``, ``eval``, ``checkpoint``,
``recovery``, ``perf``, ``parallel``, ``run``, ``lora`` and ``dpo``. The docstring under a field is its ``--help`` text
(:func:`describe_fields`). The ``[model]`` table is special: besides ``family``, ``size`` and ``init_from`` it
accepts any field of the chosen family's architecture dataclass (e.g. ``n_layers``), validated by
:func:`gptoughts.models.model_args`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union


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
    """Fraction of documents held out for validation (at least one document, ~1 KiB of a small corpus; 0 holds
    nothing out and the run is not evaluated)."""
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
    """wsd only: fraction of the run spent decaying at the end (fewer steps where the warmup runs into it: the
    decay starts where the warmup ends)."""
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
    objective: Literal["auto", "dpo"] = "auto"
    """What the run optimizes: auto (the family's own: next-token loss on text or on SFT responses, masked
    diffusion for LLaDA) or dpo (preference tuning of a pretrained model, ``gptoughts finetune --objective dpo``:
    JSONL pairs {"prompt", "chosen", "rejected"}; see ``[dpo]``)."""
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
    """Early stopping's patience resets when an evaluation is lower by more than this than the one that last reset
    it; the best checkpoint is the lowest val loss whatever this is."""
    sample_interval: int | None = None
    """Generate samples every N steps; None means at each evaluation; 0 disables."""
    sample_prompts: list[str] | None = None
    """Prompts of the samples (samples.txt, TensorBoard); an empty list disables sampling; None: the first words
    of the corpus (chat data: a greeting)."""
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
    fp8_recipe: Literal["tensorwise", "rowwise", "fused_rowwise"] = "tensorwise"
    """tensorwise (one scale per tensor, fastest of torchao's) or rowwise (one scale per row, more robust), both
    torchao's; or fused_rowwise (no torchao; llama family, no tensor parallelism): each activation quantized per row
    inside the kernel that makes it (RMSNorm, SwiGLU) under torch.compile, forward and input-gradient matmuls
    through ``torch._scaled_mm``, weight gradients in bf16 (``gptoughts/perf/fp8_fused.py``)."""
    fp8_bf16_end_layers: int = 0
    """With fp8: keep the first and the last this-many transformer blocks in bf16 (closer loss, less speed)."""
    fp8_fast_accum: bool = False
    """With fp8: the backward's matmuls (input and weight gradients) also accumulate in the tensor cores' fast,
    lower-precision mode, as the forward's already do (torchao's default keeps them precise). 3b on an H100:
    1.23-1.24x bf16 instead of 1.19-1.21x (tensorwise; rowwise not measured); 300-step losses of 3 runs no
    worse than bf16's, but nothing longer was checked, hence off by default (bench/BENCHMARKS.md)."""
    fp8_wgrad: Literal["bf16", "fp8"] = "bf16"
    """With ``fp8_recipe = fused_rowwise``: the weight gradients in bf16 (accurate; a third of the matmuls stay
    bf16) or in fp8 too (dy and the input quantized per channel over the tokens). At 3b on an H100 the bf16 weight
    gradients took 62 of fused_rowwise's 137 ms of matmuls a step (bench/BENCHMARKS.md); fp8 is not yet measured."""
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
    muon_compile: bool = False
    """train.optimizer = muon: each group of same-shape matrices steps as one compiled graph on CUDA (momentum,
    bf16 cast, norm, Newton-Schulz and the update; the stack and casts fused into the matmuls' neighbours), eager
    on CPU. Same update as the eager step up to fp32/bf16 rounding; the first step compiles (seconds)."""
    muon_distribute: bool = False
    """train.optimizer = muon under FSDP2/TP (sharded matrices): each rank orthogonalizes 1/N of each group of
    same-shape matrices (one all-to-all in, one out) instead of every rank gathering and orthogonalizing all
    of them. Same update up to bf16 rounding (the matrices are iterated as a batch)."""
    muon_graph: bool | str = "auto"
    """train.optimizer = muon: the optimizer's whole step (every group of matrices' Newton-Schulz, AdamW's groups)
    replayed as one CUDA graph, so that its many small kernels cost no launches. auto: on where the model's steps
    are CUDA graphs (perf.cuda_graphs: the gradients stay where the graph reads them) and every parameter is a whole
    CUDA tensor (one process or DDP). The graph keeps its working memory (Newton-Schulz's batches) between steps."""
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
    ep: int = 1
    """Expert-parallel degree (MoE families): the routed experts of every MoE layer are split over ``ep`` ranks of
    the data-parallel group (each holds ``n_routed_experts / ep``), tokens travel to the rank of their expert and
    back by all-to-all (one host sync per MoE layer for the split sizes); FSDP2 shards everything else over all
    ranks, and each expert over the ranks holding the same experts. The world size and the expert count must be
    multiples of ``ep``; not with ``tp``, ``pp`` or ``cpu_offload``."""
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
    grad_sync_every_microbatch: bool | str = "auto"
    """FSDP2 with gradient accumulation: reduce-scatter the gradients after every micro-batch (true), or only after
    the step's last (false: fewer collectives, but between micro-batches each GPU holds the whole model's unsharded
    fp32 gradient: 26 GiB at 7B). auto: false when that gradient is at most 10% of the GPU's memory (1b on an
    H100: 4.6 of 79 GiB), true otherwise and under CPU offload; on one host the reduce-scatters overlap the
    backward."""
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
class DpoConfig:
    """``[dpo]``: preference tuning (``train.objective = dpo``)."""

    beta: float = 0.1
    """Strength of the pull toward the reference model: the implicit reward is beta x the change of the
    log-ratio chosen/rejected from the reference's (> 0)."""
    label_smoothing: float = 0.0
    """Probability that a pair's preference is flipped (conservative DPO); 0 is the original DPO loss (in [0, 0.5))."""
    reference: Literal["auto", "precomputed", "adapters_off"] = "auto"
    """Where the reference log-probabilities come from: precomputed (one pass of the starting model over every
    pair before training, kept with the examples: no second model in memory), adapters_off (LoRA only: the same
    model with its adapters disabled, one extra no-grad forward per step) or auto (adapters_off with LoRA,
    precomputed otherwise). With LoRA both give the same values (the adapters start at zero); precomputed saves
    the extra forward."""
    head: Literal["fused", "chunked", "plain"] = "fused"
    """How the LM head and the loss run (gptoughts/training/dpo_head.py). fused: a chunk of whole pairs at a
    time, the chunk's loss and its gradients w.r.t. the hidden states and the head computed in the forward (the
    same values as plain, one chunk of fp32 logits alive, no head recompute); chunked: rows a chunk at a time
    under activation checkpointing (the head recomputed in the backward); plain: the logits of every row at once
    (2 rows x 1024 tokens x 128k vocab is 1 GiB of fp32 logits). fused and chunked also walk the reference and
    evaluation passes in chunks. fused is the default: on an H100 (LoRA, 1b) it ran 1.14x plain's tokens/s in half
    its memory (bench/BENCHMARKS.md)."""
    logp_chunk: int = 0
    """Rows per chunk of the LM head for head fused or chunked (fused with a trained head, full fine-tuning, takes
    whole pairs: rounded down to an even number, at least 2); 0: one pair (2 rows). More rows: larger matmuls,
    more memory (one row of 1024 tokens at a 128k vocab is 0.5 GiB of fp32 logits)."""
    logp_chunk_tokens: int = 0
    """Tokens per chunk, across row boundaries, where rows need not stay together: the fused head when the head
    is frozen (LoRA) and the no-gradient passes (the reference, evaluations) of fused and chunked; 0: logp_chunk
    rows' tokens. Below a row's length it cuts the LM head's memory further (smaller matmuls)."""

    def resolved_reference(self, lora: bool) -> str:
        """``reference`` with auto decided: adapters_off with LoRA, precomputed otherwise."""
        return self.reference if self.reference != "auto" else "adapters_off" if lora else "precomputed"


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
    dpo: DpoConfig = field(default_factory=DpoConfig)
    resolved: dict[str, str] = field(default_factory=dict)
    """Settings the run did not give that were decided from outside the config files (a fine-tuning run's block
    from its model's positions; the memory layout, ``perf/layout.py``), each with why, for the run plan; not a
    section of config.toml."""
    given: frozenset[str] | None = field(default=None, compare=False, repr=False)
    """The dotted keys the user set: the preset or TOML file named (a resumed run's config.toml) and the flags; not
    the family's size defaults (``presets/sizes.toml``) nor the dataclass defaults. Automatic choices leave them
    alone (:meth:`is_given`). None: a Config built in code. Where a value came from, not part of it (not
    compared)."""

    shipped: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)
    """Of :attr:`given`, the keys a shipped preset (``gptoughts/presets/``) set and no flag changed: our choices for
    that preset (the quickstart's 6 MB cap on its demo corpus), which the plan states without warning about them."""

    flags: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)
    """Of :attr:`given`, the keys this command's flags set (empty for a Config built in code). A resumed run's
    :attr:`given` also holds what its first command set: a choice kept across a resume (its global batch on another
    number of processes) yields only to what the user typed now."""

    origin: str | None = field(default=None, compare=False, repr=False)
    """Where :attr:`given`'s keys that no flag set come from, as the user would find it: the preset or TOML file
    named (``good.toml``), or the resumed run's ``config.toml``; None for a Config built in code. The plan names
    it beside a stopping rule the command did not type."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("resolved")
        d.pop("given")
        d.pop("shipped")
        d.pop("flags")
        d.pop("origin")
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
    "dpo": DpoConfig,
}


def bare_keys(sections: tuple[str, ...] = tuple(SECTIONS)) -> dict[str, str]:
    """field name -> dotted key for every field of ``sections`` (no two sections share a field name): the bare
    names the command line accepts, and what the Python API suggests for one."""
    return {
        f: f"{sec}.{f}" for sec in sections for f in SECTIONS[sec].__dataclass_fields__ if f != "overrides"
    }


# Keys that moved out of [train] (it held 42 fields) into sections of their own: the old dotted spellings and
# old TOML files keep working.
MOVED: dict[str, str] = {
    f"train.{f.name}": f"{sec}.{f.name}"
    for sec, cls in (("eval", EvalConfig), ("checkpoint", CheckpointConfig), ("recovery", RecoveryConfig))
    for f in dataclasses.fields(cls)
}


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
