"""``gptoughts eval RUN --prefs FILE.jsonl``: the preference accuracy of a model on held-out pairs.

Each pair's margin is ``beta * (m_policy - m_ref)``, ``m = log p(chosen) - log p(rejected)`` summed over the
completion tokens (rendered as training renders them, ``data/prefs.py``); the accuracy is the share of pairs with a
positive margin. The reference: ``--ref PATH`` when given; a LoRA run's base (its adapters disabled); a full
fine-tuning run's starting model (``model.init_from``); none for a plain model folder (then ``m_ref = 0``: the
share of pairs whose chosen completion is the more likely one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


def _logratios(model: nn.Module, data: Any, batch_size: int, objective: Any) -> torch.Tensor:
    device = next(model.parameters()).device
    out = [
        objective.logratio(model, x, y).double().cpu()
        for x, _, y in data.batches(np.arange(len(data)), batch_size, device)
    ]
    return torch.cat(out)


@torch.no_grad()
def evaluate_preferences(
    loaded: Any,
    sources: list[str],
    *,
    batch_size: int = 8,
    block_size: int | None = None,
    beta: float | None = None,
    reference: Any = None,
    reference_name: str | None = None,
) -> dict[str, Any]:
    """Accuracy and mean reward margin of ``loaded`` (``api.Loaded``) on the pairs of ``sources``. ``reference``:
    a loaded reference model (``api.Loaded``), or None for the default of the module docstring."""
    from gptoughts.data.prefs import PrefData
    from gptoughts.training.dpo import DPO, _tuner_layers, adapters_disabled

    cfg = loaded.config
    beta = cfg.dpo.beta if beta is None else beta
    data = PrefData(
        sources, loaded.tokenizer, block_size=block_size or cfg.train.block_size, val_fraction=0.0
    )
    objective = DPO(beta=beta)
    model = loaded.model.eval()
    policy = _logratios(model, data, batch_size, objective)
    layers = _tuner_layers(model)
    if reference is not None:
        ref = _logratios(reference.model.eval(), data, batch_size, objective)
        name = reference_name or str(reference.checkpoint)
    elif layers:
        with adapters_disabled(layers):
            ref = _logratios(model, data, batch_size, objective)
        name = "the base model (adapters disabled)"
    else:
        ref, name = torch.zeros_like(policy), "none (log p(chosen) > log p(rejected))"
    margin = beta * (policy - ref)
    return {
        "preference_accuracy": float((margin > 0).double().mean()),
        "reward_margin": float(margin.mean()),
        "pairs": len(data),
        "beta": beta,
        "reference": name,
    }


def default_reference(loaded: Any) -> str | None:
    """The starting model of a full fine-tuning run (``model.init_from``) when it is still there; None for a LoRA
    run (its base is in memory already) and for a model folder (its own ``init_from``)."""
    init_from = loaded.init_from
    if not init_from or loaded.config.lora.enabled or Path(init_from) == Path(loaded.checkpoint):
        return None
    return init_from if Path(init_from).is_dir() else None
