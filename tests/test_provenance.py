"""A run's invocations: recorded at each start, read back in order, and the
working time summed over them (fluxjax/provenance.py)."""

import json

from fluxjax import provenance
from fluxjax.rl import base_card, metrics


def test_each_start_is_recorded_with_the_commit_it_ran(tmp_path):
  first = provenance.record_invocation(str(tmp_path))
  second = provenance.record_invocation(str(tmp_path))
  read = provenance.invocations(str(tmp_path))
  assert read == [first, second] and read[0]["time"] <= read[1]["time"]
  assert first["commit"] == provenance.commit() != "unknown"  # the tests run in a checkout
  assert provenance.invocations(str(tmp_path / "none")) == []


def test_busy_time_ends_each_invocation_at_its_last_record():
  starts = [100.0, 500.0, 900.0]
  # killed at 150 (its last record), preempted after 700, finished at 1000;
  # the idle gaps between invocations do not count.
  records = [110.0, 150.0, 520.0, 700.0, 950.0, 1000.0]
  assert provenance.busy_seconds(starts, records) == 50.0 + 200.0 + 100.0
  assert provenance.busy_seconds([100.0], []) == 0.0


def test_the_base_card_names_the_commit_the_run_started_at(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"seed": 3}))
  lines = [
    {"time": 10.0, "commit": "aaaaaaa", "tree_dirty": False},
    {"time": 100.0, "commit": "bbbbbbb", "tree_dirty": True},
  ]
  with open(tmp_path / provenance.INVOCATIONS, "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in lines)
  with open(tmp_path / metrics.JSONL, "w") as f:
    for step, t in ((-3, 12.0), (-2, 40.0), (-2, 130.0), (-1, 160.0)):
      f.write(json.dumps({"step": step, "time": t, "sft/loss": 1.0}) + "\n")
  card = base_card.provenance(str(tmp_path))
  assert card["commit"] == "aaaaaaa" and card["invocations"] == 2 and card["seed"] == 3
  assert card["wall_time_s"] == 30.0 + 60.0 and card["sft_steps"] == 3


def test_a_refined_base_keeps_its_parents_card_and_a_recard_keeps_its_own(tmp_path):
  """The card's lineage (`base_card._lineage`): a run that refined the base
  in a folder (model.hf_path) and exported over it finds the parent's card
  there; carding the same weights again keeps the first card's commit and
  parent; the command is the first invocation's, less its work directory."""
  base = tmp_path / "base"
  base.mkdir()
  (base / "model.safetensors").write_bytes(b"weights v2")
  (tmp_path / "config.json").write_text(json.dumps({"model": {"hf_path": str(base)}}))
  parent = {"commit": "d307094", "command": "python -m fluxjax.train --config=configs/pretrain.py"}
  lineage = base_card._lineage(str(tmp_path), str(base), parent)
  assert lineage == {"parent": parent}
  own = {
    "commit": "aaaaaaa",
    "parent": parent,
    "weights_sha256": base_card.weights_sha256(str(base)),
  }
  assert base_card._lineage(str(tmp_path), str(base), own) == {
    "commit": "aaaaaaa",
    "parent": parent,
  }
  # Other weights: that card is not this base's.
  (base / "model.safetensors").write_bytes(b"weights v3")
  assert base_card._lineage(str(tmp_path), str(base), own) == {"parent": own}
  # A base trained from scratch, carded again by a card from before the hash.
  (tmp_path / "config.json").write_text(json.dumps({"model": {"hf_path": ""}}))
  assert base_card._lineage(str(tmp_path), str(base), {"commit": "bbbbbbb"}) == {
    "commit": "bbbbbbb"
  }
  assert base_card._lineage(str(tmp_path), str(base), None) == {}
  # A refining run kept its parent's card before its export replaced the folder.
  (tmp_path / "config.json").write_text(json.dumps({"model": {"hf_path": str(base)}}))
  (base / "card.json").write_text(json.dumps(parent))
  provenance.keep_parent_card(str(base), str(tmp_path))
  (base / "card.json").unlink()
  assert base_card._lineage(str(tmp_path), str(base), None) == {"parent": parent}
  # Kept once: a resumed run does not take the new card for its parent.
  (base / "card.json").write_text(json.dumps(own))
  provenance.keep_parent_card(str(base), str(tmp_path))
  assert provenance.parent_card(str(tmp_path)) == parent
  argv = ["train.py", "--config=configs/pretrain.py:refine", "--workdir=/w", "--config.seed=1"]
  assert base_card._command(argv) == (
    "python -m fluxjax.train --config=configs/pretrain.py:refine --config.seed=1"
  )
