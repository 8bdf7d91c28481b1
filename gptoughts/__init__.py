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

from gptoughts.api import evaluate, export, finetune, load, train
from gptoughts.api import generate_text as generate
from gptoughts.errors import ConfigError, DataError, HardwareError, UserError

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
