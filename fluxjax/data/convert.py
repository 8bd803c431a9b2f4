r"""Public VLM datasets into the rows fluxjax reads (docs/data.md, "Converters").

  python -m fluxjax.data.convert geo3k RAW_DIR_OR_PARQUET OUT.parquet [--split train]

`CONVERTERS` maps a dataset's name to its row converter. Only pyarrow is needed (no
`datasets`): point it at the files `huggingface-cli download hiyouga/geometry3k
--repo-type dataset` fetched.
"""

from __future__ import annotations

import argparse
import glob
import os

GEO3K_INSTRUCTION = (
  "You FIRST think about the reasoning process as an internal monologue and then provide "
  "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
  "The final answer MUST BE put in \\boxed{}."
)


def geo3k_rows(raw: list[dict], split: str, data_source: str = "hiyouga/geometry3k") -> list[dict]:
  r"""Rows of the raw geometry3k table, in veRL's layout.

  `raw` is hiyouga/geometry3k as the HF hub stores it: `images` (a list of {"bytes",
  "path"}), `problem` (text with an `<image>` placeholder) and `answer`. Each row is
  written as veRL's examples/data_preprocess/geo3k.py writes it: `prompt` a one-turn chat
  of the problem and an instruction to think in <think></think> and answer in \boxed{},
  `images` unchanged, `data_source`, `ability`, `reward_model` {"style": "rule",
  "ground_truth"} and `extra_info` {split, index, answer, question}. fluxjax reads that
  file as it is (and veRL's own output too); the reward is yours to give
  (docs/rewards.md), e.g. a \boxed{} checker.
  """
  out = []
  for index, r in enumerate(raw):
    problem, answer = r["problem"], r["answer"]
    out.append(
      {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{problem} {GEO3K_INSTRUCTION}"}],
        "images": r["images"],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
      }
    )
  return out


def _parquet_files(path: str, split: str) -> list[str]:
  if os.path.isfile(path):
    return [path]
  files = sorted(glob.glob(os.path.join(path, "**", f"{split}-*.parquet"), recursive=True))
  if not files:
    raise SystemExit(f"fluxjax.data.convert: no {split}-*.parquet under {path}")
  return files


CONVERTERS = {"geo3k": geo3k_rows}


def main(argv: list[str] | None = None) -> None:
  import pyarrow as pa
  import pyarrow.parquet as pq

  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dataset", choices=sorted(CONVERTERS))
  p.add_argument("source", help="a raw Parquet file, or the folder the hub download made")
  p.add_argument("out", help="the Parquet file to write")
  p.add_argument("--split", default="train", help="the split's file prefix (train, test, ...)")
  args = p.parse_args(argv)
  raw = [r for f in _parquet_files(args.source, args.split) for r in pq.read_table(f).to_pylist()]
  rows = CONVERTERS[args.dataset](raw, args.split)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), args.out)
  print(f"wrote {len(rows)} {args.dataset} rows ({args.split}) to {args.out}")


if __name__ == "__main__":
  main()
