"""gptoughts: train language models from scratch and fine-tune Hugging Face models, fast.

Python API::

    import gptoughts
    model, tokenizer, history = gptoughts.train(data_path="corpus.txt", model="llama", size="125m",
                                                num_epochs=1, batch_size=8, learning_rate=3e-4,
                                                save_dir="runs/my-run", device="cuda")
    loaded = gptoughts.load("runs/my-run")
    print(gptoughts.generate(loaded, "def fibonacci(n):"))

    # fine-tune a local Hugging Face model folder (LoRA), then write it back as a transformers folder
    gptoughts.finetune(model_path="my-hf-model", data_path="chats.jsonl", lora=True, save_dir="runs/ft")
    gptoughts.export("runs/ft", "my-hf-model-ft")
"""

from typing import Any

from gptoughts.errors import ConfigError, DataError, HardwareError, UserError

# The API is imported on first use (PEP 562), not with the package: ``gptoughts --version``, ``--help`` and the
# CLI's light commands then start without torch (--version in 0.1 s instead of 2.8: docs/performance.md).
_API = {
    "train": "train",
    "finetune": "finetune",
    "export": "export",
    "load": "load",
    "generate": "generate_text",
    "evaluate": "evaluate",
}


def __getattr__(name: str) -> Any:
    if name in _API:
        from gptoughts import api

        return getattr(api, _API[name])
    raise AttributeError(f"module 'gptoughts' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


__version__ = "0.1.0"
__all__ = [
    "train",
    "finetune",
    "export",
    "load",
    "generate",
    "evaluate",
    "UserError",
    "ConfigError",
    "DataError",
    "HardwareError",
]
