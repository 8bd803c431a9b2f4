"""What training did to responses of each length: figures per length quintile.

Reads the response records a run wrote to trained.jsonl
(`coordinator.response_records`, fluxjax/rl/records.py) and gives, per
response-length quintile (edges from a baseline run's lengths, so two runs'
rows compare the same lengths):

  responses     trained responses in the quintile;
  gap           mean version gap of their tokens (against the version trained);
  carried       share continued across rounds or publishes (> 1 version);
  truncated     share of their tokens whose importance weight hit the cap;
  prompt wt     a prompt's summed loss weight x P (1.0: an average prompt's
                share of a step), prompts placed by their mean response length;
  token wt      a token's loss weight x the run's mean trained tokens per
                step (1.0 everywhere: a token weighs the same whatever batch it
                lands in; token-mean gives a token of a step with T tokens
                mean(T) / T);
  accuracy      share of responses with reward >= 1.

Used by bench/async.py --quintiles (one run a mode) and bench/learning.py
--quintiles (`over_seeds`: each figure's mean over seeds and its 95% t
interval, each seed's table on its own edges).
"""

from __future__ import annotations

import collections
import statistics

import numpy as np

from seedstats import t_interval

QUINTILES = 5
# A quintile's figures (`table`), each averaged over seeds by `over_seeds`.
FIGURES = ("gap", "carried", "truncated", "prompt_weight", "token_weight", "accuracy")


def responses(trained: list[dict], after_step: int = 0) -> list[dict]:
  """The response records of steps > after_step, each with its step."""
  return [
    dict(r, step=t["step"])
    for t in trained
    if t["step"] > after_step
    for r in t.get("responses", ())
  ]


def edges(records: list[dict]) -> np.ndarray:
  """Inner quintile edges of the records' response lengths; tied edges (many
  responses of one length) merge their quintiles, so there may be fewer."""
  lengths = np.array([r["length"] for r in records], float)
  return np.unique(np.quantile(lengths, np.linspace(0, 1, QUINTILES + 1)[1:-1]))


def _bin(length: float, inner: np.ndarray) -> int:
  """The quintile (0-based) of a length: [edge i-1, edge i), so a length on an
  edge opens the next quintile."""
  return int(np.searchsorted(inner, length, side="right"))


def _prompt_weights(records: list[dict], prompts_per_step: int, inner: np.ndarray):
  """{quintile: [prompt weight x P]}: each prompt's summed loss weight within
  its step, binned by its responses' mean length."""
  groups = collections.defaultdict(list)
  for r in records:
    groups[(r["step"], r["sample_id"])].append(r)
  out = collections.defaultdict(list)
  for rs in groups.values():
    weight = sum(r["loss_weight"] for r in rs) * prompts_per_step
    out[_bin(np.mean([r["length"] for r in rs]), inner)].append(weight)
  return out


def table(records: list[dict], inner: np.ndarray, prompts_per_step: int) -> list[dict]:
  """One row per quintile (the module docstring's figures)."""
  tokens_per_step = collections.Counter()
  for r in records:
    tokens_per_step[r["step"]] += r["length"]
  mean_tokens = np.mean(list(tokens_per_step.values()))
  prompt_w = _prompt_weights(records, prompts_per_step, inner)
  bins = collections.defaultdict(list)
  for r in records:
    bins[_bin(r["length"], inner)].append(r)
  bounds = [None, *map(float, inner), None]  # [lo, hi), as `_bin` places: None is open
  rows = []
  for q in range(len(inner) + 1):
    rs = bins.get(q, [])
    lengths = np.array([r["length"] for r in rs], float)
    row = {"quintile": q + 1, "lengths": (bounds[q], bounds[q + 1]), "responses": len(rs)}
    if rs:
      trunc = np.array([r["token_means"]["is_truncated"] for r in rs])
      per_token = [r["loss_weight"] / r["length"] * mean_tokens for r in rs]
      row.update(
        length=float(lengths.mean()),
        gap=float(np.mean([r["gap_mean"] for r in rs])),
        carried=float(np.mean([r["versions"] > 1 for r in rs])),
        truncated=float((trunc * lengths).sum() / lengths.sum()),
        prompt_weight=float(np.mean(prompt_w[q])) if prompt_w.get(q) else float("nan"),
        token_weight=float(np.mean(per_token)),
        accuracy=float(np.mean([r["reward"] >= 1.0 for r in rs])),
      )
    rows.append(row)
  return rows


def over_seeds(tables: list[list[dict]]) -> list[dict]:
  """Per quintile, each figure's mean over the tables (one a seed, each on
  its seed's edges) that have responses there, with its 95% t half-width as
  `<figure>_ci95`."""
  rows = []
  for q, first in enumerate(tables[0]):
    cells = [t[q] for t in tables if len(t) > q and t[q]["responses"]]
    lengths = (_mean_bound(cells, 0), _mean_bound(cells, 1))
    row = {"quintile": first["quintile"], "lengths": lengths, "seeds": len(cells)}
    row["responses"] = sum(c["responses"] for c in cells)
    if cells:
      row["length"] = statistics.fmean(c["length"] for c in cells)
      for key in FIGURES:
        values = [c[key] for c in cells if not np.isnan(c[key])]
        row[key] = statistics.fmean(values) if values else float("nan")
        row[f"{key}_ci95"] = t_interval(values)
    rows.append(row)
  return rows


def _mean_bound(cells: list[dict], i: int) -> float | None:
  """The seeds' mean lower (i = 0) or upper (1) edge of a quintile; None: open."""
  bounds = [c["lengths"][i] for c in cells if c["lengths"][i] is not None]
  return statistics.fmean(bounds) if bounds else None


def markdown(rows: list[dict]) -> str:
  """The rows as a table; a figure with a `_ci95` (`over_seeds`) shows it."""
  head = (
    "| quintile | tokens | responses | gap | carried | truncated | prompt wt | token wt "
    "| accuracy |\n|---|---|---|---|---|---|---|---|---|"
  )
  digits = {"gap": 2, "truncated": 4}
  cell = lambda r, key: (
    f"{r[key]:.{digits.get(key, 3)}f}"
    + (f" +- {r[f'{key}_ci95']:.{digits.get(key, 3)}f}" if f"{key}_ci95" in r else "")
  )
  lines = [head]
  for r in rows:
    lo, hi = r["lengths"]
    span = f"{'' if lo is None else f'>={lo:g}'}{'' if hi is None else f' <{hi:g}'}"
    if not r["responses"]:
      lines.append(f"| {r['quintile']} | {span.strip() or 'all'} | 0 | | | | | | |")
      continue
    lines.append(
      f"| {r['quintile']} | {span.strip() or 'all'} (mean {r['length']:.1f}) | {r['responses']} | "
      + " | ".join(cell(r, key) for key in FIGURES)
      + " |"
    )
  return "\n".join(lines)
