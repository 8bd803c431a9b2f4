"""Model FLOPs of a training step, and the devices' dense bf16 peaks.

MaxText's convention: matmuls only, x3 for forward + backward, no rematerialization
counted (`text_flops`, `vision_flops`). MFU = model FLOPs / time / (peak x devices);
bench/mfu.py measures it for one step, the run logs it per step (rl/step_metrics.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fluxjax.models import config as config_lib

# Dense bf16 FLOP/s by device kind (datasheets, SXM parts).
DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12, "B200": 2250e12}


def datasheet_peak(device_kind: str) -> float | None:
  """The dense bf16 peak of a device kind, or None (a CPU, an unknown part)."""
  return next((v for k, v in DATASHEET_BF16.items() if k in device_kind), None)


def decoder_matmul_weights(t: config_lib.TextConfig) -> int:
  """Matmul weights a token passes through: every decoder layer's (q, k, v, o,
  gate, up, down) and the LM head; the embedding is a lookup."""
  d, n, k, h, f = t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size
  return t.num_layers * (d * (n + 2 * k) * h + n * h * d + 3 * d * f) + d * t.vocab_size


def text_flops(cfg: config_lib.ModelConfig, lengths: Iterable[int]) -> float:
  """Training FLOPs of the decoder and LM head over sequences of `lengths` tokens.

  Per token 2 x (D(N+2K)h + NhD + 3DF) per layer, plus the LM head 2DV; attention 4 N h
  per visible query-key pair (causal: s(s+1)/2 pairs per sequence of s tokens).
  """
  t = cfg.text
  lengths = list(lengths)
  pairs = sum(s * (s + 1) // 2 for s in lengths)
  attention = t.num_layers * 4 * t.num_heads * t.head_dim * pairs
  return 3.0 * (2 * decoder_matmul_weights(t) * sum(lengths) + attention)


def _sides(n: int, window: int) -> list[int]:
  return [window] * (n // window) + ([n % window] if n % window else [])


def vision_flops(cfg: config_lib.ModelConfig, grids: Sequence[tuple[int, int, int]]) -> float:
  """Training FLOPs of the vision tower over images/videos of (t, h, w) patch grids.

  Per patch 2 x patch dim x Dv (the embedding) and 2 x (4 Dv^2 + 3 Dv Fv) per block;
  attention 4 Dv per pair within a frame (full blocks) or within its windows; the merger
  2 x (16 Dv^2 + 4 Dv D) per merged token.
  """
  v = cfg.vision
  dv, fv = v.hidden_size, v.intermediate_size
  full = len(v.fullatt_block_indexes)
  window = v.window_merged_units * v.spatial_merge_size
  total = 0.0
  for t, h, w in grids:
    patches = t * h * w
    # Attention stays within a frame group; window blocks within each window.
    windowed = sum(a * a for a in _sides(h, window)) * sum(b * b for b in _sides(w, window))
    attn_pairs = t * (full * (h * w) ** 2 + (v.depth - full) * windowed)
    total += (
      patches * 2 * v.patch_dim * dv
      + v.depth * patches * 2 * (4 * dv * dv + 3 * dv * fv)
      + 4 * dv * attn_pairs
      + patches // v.merge_unit * 2 * (16 * dv * dv + 4 * dv * v.out_hidden_size)
    )
  return 3.0 * total
