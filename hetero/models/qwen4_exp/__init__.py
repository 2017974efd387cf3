"""Qwen4-Exp (Qwen3.8-Flash-Next): `qwen4_exp` (nested) and `qwen4_exp_text` (flat) checkpoints.

What differs from Qwen3.5 (transformers 5.25 `models/qwen4_exp/` is the reference):
- `hyper`: hc_count residual streams, a low-rank input mixer with a grouped RMSNorm before every block, and a final
  mixer instead of the final norm;
- `qsa`: gated GQA whose keys are chosen per query by a token indexer over compressed key blocks;
- `ple`: per-layer hashed n-gram embeddings (sigmoid gate + dilated depthwise conv) on a few GDN layers;
- `model`: routed + shared experts on every layer, the GDN's sigmoid output gate, the whole causal LM and its MTP head
  (the backbone's streams and the next token through one QSA + MoE layer with its own mixer);
- `step`: a layer's few-token step (decode, verify, draft) as compiled functions.
"""
