"""Qwen3.5 / Qwen3.6 / Qwen3-Next: `args` (config.json -> `ModelArgs`), `weights` (checkpoint -> parameters),
`layers` (attention, GDN, MLP, RMSNorm), `model` (the decoder layer, the causal LM and its MTP head),
`architecture` (the family as the engine asks it)."""

from hetero.models.gated_delta import RECURRENT_MAX_TOKENS
from hetero.models.qwen3_5.args import MODEL_TYPES, ModelArgs
from hetero.models.qwen3_5.layers import MLP, Attention, GatedDeltaNet, RMSNorm, causal_depthwise_conv, rms_norm
from hetero.models.qwen3_5.model import DecoderLayer, Model

__all__ = ["MLP", "MODEL_TYPES", "RECURRENT_MAX_TOKENS", "Attention", "DecoderLayer", "GatedDeltaNet", "Model",
           "ModelArgs", "RMSNorm", "causal_depthwise_conv", "rms_norm"]
