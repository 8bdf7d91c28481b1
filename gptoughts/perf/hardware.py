"""Hardware detection: what this machine is, what it supports, and what ``auto`` settings mean on it."""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from gptoughts.errors import HardwareError

# Dense (no sparsity) peak tensor-core throughput in FLOP/s, from the vendors' datasheets. MFU is computed
# against the bf16 figure; fp8 runs report "MFU-equivalent" against the same bf16 peak, as torchtitan does.
_PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 125e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


@dataclass
class HardwareProfile:
    device: str
    """torch device string of this process (cuda:N, mps or cpu)."""
    name: str
    """GPU name, or the CPU's."""
    arch: str
    """hopper, blackwell, ada, ampere, older, mps or cpu."""
    compute_capability: tuple[int, int] | None
    memory_bytes: int | None
    gpu_count: int
    cpu_count: int
    peak_bf16_flops: float | None
    bf16: bool
    fp16: bool
    fp8: bool
    compile: bool
    recommended: dict[str, object] = field(default_factory=dict)
    torch_version: str = torch.__version__

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _arch(cc: tuple[int, int]) -> str:
    major, minor = cc
    if major >= 10:
        return "blackwell"
    if major == 9:
        return "hopper"
    if (major, minor) == (8, 9):
        return "ada"
    if major == 8:
        return "ampere"
    return "older"


def _words(name: str) -> str:
    """``name`` as lower-case words of letters or digits, space-padded: "NVIDIA A100-SXM4-40GB" and "a100 sxm4
    40gb" both read " nvidia a 100 sxm 4 40 gb ", "rtx4090" reads as "RTX 4090"."""
    return " " + " ".join(re.findall(r"[a-z]+|[0-9]+", name.lower())) + " "


def match_gpu(name: str, keys: Iterable[str]) -> str | None:
    """The key of a GPU table that ``name`` names (the most specific one: "H100 PCIe" before "H100"), by whole
    words: "L40" is not an "L4", "GH200" not an "H200"; case, spaces and dashes do not matter. None: none."""
    words = _words(name)
    return next((k for k in sorted(keys, key=lambda k: -len(_words(k))) if _words(k) in words), None)


def peak_flops(name: str) -> float | None:
    """Datasheet dense bf16 peak for a GPU name (None when unknown)."""
    key = match_gpu(name, _PEAK_BF16)
    return None if key is None else _PEAK_BF16[key]


# The GPUs of the table above without fp8 tensor cores (before Ada): `--fp8` is refused on them.
_NO_FP8 = ("A100", "A10G", "A10", "RTX 3090", "V100", "T4")


# The architecture of each GPU of the table above by name (``gptoughts estimate --gpu NAME`` has no device to ask).
_ARCH = {"H200": "hopper", "H100": "hopper", "GH200": "hopper", "B200": "blackwell", "L40S": "ada", "L40": "ada",
         "L4": "ada", "RTX 4090": "ada", "A100": "ampere", "A10G": "ampere", "A10": "ampere", "RTX 3090": "ampere",
         "V100": "older", "T4": "older"}  # fmt: skip


def arch_of(name: str) -> str | None:
    """The architecture of a GPU of this name, as :class:`HardwareProfile` names it; None when the name is unknown."""
    key = match_gpu(name, _ARCH)
    return None if key is None else _ARCH[key]


def fp8_auto(arch: str, d_model: int, recipe: str) -> tuple[bool, str]:
    """``perf.fp8 = auto`` on a GPU of ``arch`` for a model of ``d_model``, and why: on from Hopper, at d_model 2048
    and above, where torchao is installed (the fused recipe is our own code). What a run resolves
    (``training/resolve.py``) and ``gptoughts estimate`` counts."""
    if arch not in ("hopper", "blackwell"):
        return False, f"auto: off on {arch} (fp8 pays on Hopper and later)"
    if d_model < 2048:
        return False, f"auto: off at d_model {d_model} < 2048 (the casts cost more than the matmuls gain)"
    try:
        if recipe != "fused_rowwise":
            import torchao  # noqa: F401
    except ImportError:
        return False, "auto: off, torchao is not installed (pip install 'gptoughts[fp8]')"
    return True, "auto: Hopper+, d_model >= 2048, torchao present"


def has_fp8(name: str) -> bool | None:
    """Whether a GPU of this name has fp8 tensor cores (Ada, Hopper, Blackwell); None when the name is unknown."""
    key = match_gpu(name, _PEAK_BF16)
    return None if key is None else key not in _NO_FP8


def _compile_works() -> bool:
    # Inductor needs a C compiler on CPU and Triton on GPU; a missing one is a common cause of crashes.
    try:
        import shutil

        if torch.cuda.is_available():
            import triton  # noqa: F401

            return True
        return shutil.which("cc") is not None or shutil.which("gcc") is not None
    except Exception:
        return False


def resolve_device(requested: str = "auto") -> torch.device:
    """auto -> this rank's GPU (LOCAL_RANK), else mps, else cpu. Errors when a missing device is named."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(requested)
    except RuntimeError:
        raise HardwareError(f"unknown device {requested!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HardwareError(
            f"--device {requested} asked for a CUDA GPU but none is visible; use --device cpu or auto"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise HardwareError(f"--device {requested}: only {torch.cuda.device_count()} GPU(s) visible")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise HardwareError("--device mps asked for Apple's GPU but it is not available; use --device cpu")
    return dev


def detect(device: str | torch.device = "auto") -> HardwareProfile:
    dev = resolve_device(device) if isinstance(device, str) else device
    cpus = os.cpu_count() or 1
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        cc = (props.major, props.minor)
        arch = _arch(cc)
        prof = HardwareProfile(
            device=str(dev),
            name=props.name,
            arch=arch,
            compute_capability=cc,
            memory_bytes=props.total_memory,
            gpu_count=torch.cuda.device_count(),
            cpu_count=cpus,
            peak_bf16_flops=peak_flops(props.name),
            bf16=torch.cuda.is_bf16_supported(),
            fp16=True,
            fp8=cc >= (8, 9),
            compile=_compile_works(),
        )
    elif dev.type == "mps":
        prof = HardwareProfile(
            device="mps",
            name="Apple GPU",
            arch="mps",
            compute_capability=None,
            memory_bytes=None,
            gpu_count=1,
            cpu_count=cpus,
            peak_bf16_flops=None,
            bf16=True,
            fp16=True,
            fp8=False,
            compile=False,
        )
    else:
        prof = HardwareProfile(
            device="cpu",
            name=platform.processor() or platform.machine(),
            arch="cpu",
            compute_capability=None,
            memory_bytes=_host_memory(),
            gpu_count=0,
            cpu_count=cpus,
            peak_bf16_flops=None,
            bf16=True,
            fp16=False,
            fp8=False,
            compile=_compile_works(),
        )
    prof.recommended = recommend(prof)
    return prof


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def recommend(p: HardwareProfile) -> dict[str, object]:
    """What each ``auto`` setting resolves to on this hardware, with the reason."""
    if p.arch == "cpu":
        return {
            "precision": "fp32",
            "compile": False,
            "fp8": False,
            "fused_adamw": False,
            "batch_size": "auto: up to 8, by the memory estimate (trial steps need a GPU)",
            "activation_checkpointing": "selective for LoRA, else none",
            "cuda_graphs": False,
            "residual_dtype": "fp32",
        }
    if p.arch == "mps":
        return {
            "precision": "fp32",
            "compile": False,
            "fp8": False,
            "fused_adamw": False,
            "batch_size": "fixed",
            "activation_checkpointing": "selective for LoRA, else none",
            "cuda_graphs": False,
            "residual_dtype": "fp32",
        }
    precision = "bf16" if p.bf16 else "fp16"
    return {
        "precision": precision,
        "compile": p.compile,
        # whole-model compile +2-6% a step on the user's path below 400M (docs/performance.md)
        "compile_mode": "model for llama/gpt2 up to 400M non-embedding parameters in one process and runs of "
        "20+ min, else blocks",
        "fp8": p.arch in ("hopper", "blackwell"),  # Ada has fp8 tensor cores but small models rarely gain
        "fused_adamw": True,
        "batch_size": "auto",
        "activation_checkpointing": "selective for LoRA (19% less memory, 2-5% slower at 1b), else none; raised "
        "where the training state does not fit the GPU (perf/layout.py)",
        # LoRA steps are many small kernels: 1.06-1.2x at 1b with the launches replayed (docs/performance.md)
        "cuda_graphs": "on for LoRA on a Llama base in one process at a fixed batch, else off"
        if p.compile
        else False,
        # bf16 residual stream: +1 to +6% tokens/s on an H200 (bench/BENCHMARKS.md); only acts under bf16
        "residual_dtype": "bf16" if p.bf16 else "fp32",
    }


def resolve_precision(requested: str, prof: HardwareProfile) -> str:
    if requested == "auto":
        return str(prof.recommended["precision"])
    if requested == "bf16" and prof.arch not in ("cpu", "mps") and not prof.bf16:
        raise HardwareError(f"{prof.name} has no bf16 support; use --precision fp16 (or auto)")
    if requested == "fp16" and prof.arch == "cpu":
        raise HardwareError("fp16 training on CPU is not supported; use --precision fp32 or bf16")
    return requested


def apply_runtime_settings(device: torch.device, *, tf32: bool, expandable_segments: bool) -> None:
    """Process-wide CUDA settings of ``[perf]`` (train and bench share them)."""
    if device.type != "cuda":
        return
    if tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # Read by the caching allocator when it starts (first allocation), so it must be set before; a user's own
    # PYTORCH_CUDA_ALLOC_CONF wins.
    if (
        expandable_segments
        and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
        and not torch.cuda.is_initialized()
    ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def given_cpu_threads(requested: int | None, run_threads: int | None) -> tuple[int, str] | None:
    """The CPU thread count a run is given rather than measures, and why: ``perf.threads`` (``--threads``), else
    ``OMP_NUM_THREADS``, else the resumed run's own count (``run_threads``, from its run.json); None: measure it.
    Losses reproduce bit for bit only at the same count (1 and 2 threads differ in the last bits at a few steps
    of 20), so a resume keeps the run's count unless the user names one."""
    omp = _omp_threads()
    if requested:
        n, why = requested, "--threads"
    elif omp:
        n, why = omp, "OMP_NUM_THREADS"
    else:
        return (run_threads, "the run's own count") if run_threads else None
    if run_threads and run_threads != n:
        why += f"; the run trained at {run_threads}: --threads {run_threads} resumes it exactly"
    return n, why


def _omp_threads() -> int | None:
    # OpenMP allows a list, one count per nesting level: the first is ours
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask: a container or taskset may give it fewer)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def measure_cpu_threads(step: Callable[[], None]) -> tuple[int, str, float]:
    """Set torch's CPU thread count to the faster of one thread and every core on ``step`` (a short forward+backward
    of the run's model); returns (count, how it was measured, seconds of one step at that count).

    The default stays measured: on two cores of an idle machine two threads trained 1.4-1.5x faster than one, and
    with another process busy on one of them 10-72x slower (OpenMP's threads wait for a descheduled peer at every
    barrier; bench/BENCHMARKS.md, "CPU thread count"). No fixed count is right on both, so the run measures once,
    and run.json keeps the count for its resume. One untimed step first (allocations, lazy initialisation), then each
    count once, and again only when they are within 1.5x of each other."""
    import time

    cores = cpu_cores()
    if cores <= 1:
        torch.set_num_threads(1)
        t = time.perf_counter()
        step()
        return 1, "one core", time.perf_counter() - t
    torch.set_num_threads(1)
    step()
    timings: dict[int, float] = {}
    for _ in range(2):
        for n in (1, cores):
            torch.set_num_threads(n)
            t = time.perf_counter()
            step()
            timings[n] = min(timings.get(n, math.inf), time.perf_counter() - t)
        if max(timings.values()) > 1.5 * min(timings.values()):
            break
    best = min(timings, key=timings.__getitem__)
    torch.set_num_threads(best)
    other = cores if best == 1 else 1
    return (
        best,
        f"measured: {timings[best] * 1e3:.0f} ms per forward+backward vs {timings[other] * 1e3:.0f} ms with {other}",
        timings[best],
    )
