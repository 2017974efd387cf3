"""MIL builders for the prefill pieces that may run on the Apple Neural Engine, and the ANE lint.

Everything here is built directly with coremltools' MIL builder (no tracing), in fp16, in the ANE's preferred
`(1, C, 1, S)` layout with 1x1 convolutions for projections (shared/DESIGN.md section 5):

- `ops`        small MIL helpers: program assembly, conv1x1, exact RMSNorm via layer_norm, finite masks
- `attention`  the attention-layer prefill graph for a slice of whole KV-head groups (`attention_channels`: the
               same program in Apple's keys-on-channels layout)
- `mlp`        the MLP slice graph (a share of intermediate channels, partial sum)
- `gdn`        the GDN input-projection graph (`gdn_in_proj`: z rows only)
- `vision`     the vision tower's programs: patch embedding, one ViT block, the patch merger (per bucket of patches)
- `palette`    MLX's affine-quantized weights as per-group lookup tables (exact; `constexpr_lut_to_dense`), and
               as `constexpr_blockwise_shift_scale` where every group of a matrix has an exact scale and offset
- `package`    save a program as an .mlpackage and read its MIL back
- `lint`       static check of a saved program against the ANE's rules

Builders take numpy weights already sliced to the piece; they know nothing of MLX or of checkpoints.
"""

# the attention program's layouts (`attention.AttentionShape.layout`): the first is what exports take until a Mac's
# doctor measured the other faster; here, where importing them needs no coremltools
LAYOUTS = ("heads", "keys_on_channels")
