"""Drawing primitives of the synthetic datasets: colours, background, filled shapes."""

from __future__ import annotations

import math

import PIL.ImageDraw

RGB = {
  "red": (220, 30, 30),
  "green": (30, 170, 60),
  "blue": (30, 60, 220),
  "yellow": (240, 220, 30),
  "purple": (140, 40, 170),
  "orange": (250, 140, 20),
  "white": (255, 255, 255),
  "black": (0, 0, 0),
}
# Mid grey so that both white and black shapes stand out.
BACKGROUND = (128, 128, 128)


def _polygon(shape: str, cx: float, cy: float, r: float):
  if shape == "square":
    return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
  if shape == "triangle":
    return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
  if shape == "star":
    pts = []
    for k in range(10):
      rad = r if k % 2 == 0 else r * 0.45
      a = -math.pi / 2 + k * math.pi / 5
      pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts
  raise ValueError(shape)


def draw_shape(
  draw: PIL.ImageDraw.ImageDraw, shape: str, color: str, cx: float, cy: float, r: float
) -> None:
  """Draws one filled shape of a COLORS colour centred at (cx, cy)."""
  fill = RGB[color]
  if shape == "circle":
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
  else:
    draw.polygon(_polygon(shape, cx, cy, r), fill=fill)
