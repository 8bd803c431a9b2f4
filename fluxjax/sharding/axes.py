"""Logical axis names: the only axis vocabulary model code may use.

Parameters and activations are annotated with these names; `sharding/rules.py`
maps them to mesh axes. Weight axes and activation axes are kept apart so that,
for example, FSDP can shard `EMBED` weights while activations stay sharded by
batch/sequence only.
"""

# Weight axes.
LAYERS = "layers"  # stacked decoder / vision blocks (scanned, never sharded)
VOCAB = "vocab"
EMBED = "embed"  # text model width
MLP = "mlp"  # text MLP intermediate width
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
VIS_EMBED = "vis_embed"  # vision tower width
VIS_MLP = "vis_mlp"  # vision MLP intermediate width
VIS_HEADS = "vis_heads"
PATCH = "patch"  # flattened (C, T, P, P) patch features
MERGED = "merged"  # 2x2-merged vision width (4 * vis_embed)

# Activation axes.
ACT_BATCH = "act_batch"
ACT_SEQ = "act_seq"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_PATCHES = "act_patches"

ALL_WEIGHT_AXES = (
  LAYERS,
  VOCAB,
  EMBED,
  MLP,
  Q_HEADS,
  KV_HEADS,
  HEAD_DIM,
  VIS_EMBED,
  VIS_MLP,
  VIS_HEADS,
  PATCH,
  MERGED,
)
