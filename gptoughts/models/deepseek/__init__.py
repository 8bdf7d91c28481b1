"""DeepSeek-V3-style decoder: Multi-head Latent Attention, DeepSeekMoE, aux-loss-free balancing, MTP.

Architecture (DeepSeek-V2/V3 papers; ``transformers.DeepseekV3ForCausalLM`` is the numerical reference), one
concern per module:

* ``args``: ``DeepSeekArgs`` (validation included) and the size presets ``DEEPSEEK_SIZES``;
* ``rope``: RoPE tables with DeepSeek's ``yarn`` scaling;
* ``mla``: Multi-head Latent Attention (a compressed key/value latent plus one decoupled RoPE key shared by all
  heads) and ``MLACache``, its latent KV cache read in the absorbed form;
* ``moe``: DeepSeekMoE: the sigmoid/softmax router with bias-steered (optionally group-limited) top-k, the routed
  experts run as grouped GEMMs, the shared experts, the sequence-wise balance loss;
* ``model``: the blocks, multi-token prediction (MTP) and ``DeepSeek`` (a ``models.base.DecoderLM``) with its
  training hooks: expert-load accounting, the auxiliary-loss-free bias update, ``extra_loss``;
* ``hf``: ``DeepseekV3ForCausalLM`` config and weights, both ways (the name mapping table is there).

Size presets (``vocab_size`` as listed; "active" = parameters one token runs through, see
``DeepSeek.num_active_params``; both columns include the input embedding and the LM head):

| size | d_model | layers (dense) | heads | routed experts (top-k) + shared | moe_inter | vocab | total | active |
| ---- | ------: | -------------: | ----: | ------------------------------: | --------: | ----: | ----: | -----: |
| debug | 64 | 3 (1) | 4 | 8 (2) + 1 | 32 | 512 | 252,960 | 179,232 |
| small | 1024 | 16 (1) | 8 | 64 (6) + 2 | 320 | 32768 | 1,118,151,680 (1.12B) | 262,906,880 (263M) |
| 16b | 2048 | 27 (1) | 16 | 64 (6) + 2 | 1408 | 102400 | 15,706,484,224 (15.7B) | 2,661,150,208 (2.66B) |

``16b`` is the DeepSeek-V2-Lite shape (DeepSeek quotes 15.7B total and 2.4B active; the latter excludes the
input embedding: 2,451,435,008 here). The presets use the V3 routing recipe (sigmoid scores, normalised top-k,
scale 2.5, bias balancing) rather than V2-Lite's softmax; ``score_func = "softmax"`` gives the V2 router.
``small`` and ``16b`` use MLA head dims 128 (nope) + 64 (rope) and 128 (v), kv_lora_rank 512, no q-LoRA.
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
