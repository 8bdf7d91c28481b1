"""DeepSeek-V3-style decoder: Multi-head Latent Attention, DeepSeekMoE, aux-loss-free balancing, MTP.

Architecture (DeepSeek-V2/V3 papers; ``transformers.DeepseekV3ForCausalLM`` is the numerical reference), one
concern per module:

* ``args``: ``DeepSeekArgs`` (validation included) and the size presets ``DEEPSEEK_SIZES``;
* ``rope``: RoPE tables with DeepSeek's ``yarn`` scaling;
* ``mla``: Multi-head Latent Attention (a compressed key/value latent plus one decoupled RoPE key shared by all
  heads) and ``MLACache``, its latent KV cache read in the absorbed form;
* ``moe``: DeepSeekMoE: the sigmoid/softmax router with bias-steered (optionally group-limited) top-k, the routed
  experts run as grouped GEMMs, the shared experts, the sequence-wise balance loss;
* ``dispatch``: the padded expert-sorted row layout and the token moves to it and back (one-pass gathers);
* ``model``: the blocks, multi-token prediction (MTP) and ``DeepSeek`` (a ``models.base.DecoderLM``) with its
  training hooks: expert-load accounting, the auxiliary-loss-free bias update, ``extra_loss``;
* ``hf``: ``DeepseekV3ForCausalLM`` config and weights, both ways (the name mapping table is there).

Size presets (``debug``, ``small``, ``16b``: the DeepSeek-V2-Lite shape with the V3 router) and their total
and active parameter counts: ``docs/models.md``.
"""

from gptoughts.models.deepseek.args import DEEPSEEK_SIZES, DeepSeekArgs
from gptoughts.models.deepseek.hf import HF_MODEL_TYPES, args_from_hf, from_hf, hf_config, to_hf
from gptoughts.models.deepseek.mla import MLA, MLACache
from gptoughts.models.deepseek.model import IGNORE_INDEX, DeepSeek, DeepSeekBlock, MultiTokenPrediction
from gptoughts.models.deepseek.moe import EXPERT_ROW_ALIGN, GroupedExperts, MoE, grouped_mm_supported
from gptoughts.models.deepseek.rope import DeepSeekRotary

__all__ = [
    "DEEPSEEK_SIZES",
    "EXPERT_ROW_ALIGN",
    "HF_MODEL_TYPES",
    "IGNORE_INDEX",
    "MLA",
    "DeepSeek",
    "DeepSeekArgs",
    "DeepSeekBlock",
    "DeepSeekRotary",
    "GroupedExperts",
    "MLACache",
    "MoE",
    "MultiTokenPrediction",
    "args_from_hf",
    "from_hf",
    "grouped_mm_supported",
    "hf_config",
    "to_hf",
]
