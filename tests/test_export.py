"""python -m fluxjax.export: a run's checkpoint as an HF folder transformers loads."""

import json
import os

import jax
import numpy as np
import pytest
import safetensors
from flax import nnx

from fluxjax import config_args, export
from fluxjax.models import inputs
from fluxjax.rl import loop

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tensors(folder) -> dict[str, np.ndarray]:
  with safetensors.safe_open(os.path.join(folder, "model.safetensors"), "np") as f:
    return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)


@pytest.mark.slow
def test_a_runs_checkpoint_exports_to_a_folder_transformers_loads(tmp_path):
  """Two RL steps of the tiny job (random weights, checkpoints at 1 and 2);
  each step exports its own checkpoint's weights, which
  `from_pretrained` loads whole and whose logits are the policy's; an old
  run's config.json (a field removed) still exports, with a note."""
  config = config_args.load_config(os.path.join(ROOT, "configs", "vlm.py"), "tiny")
  config.sft.enabled = False
  config.total_steps, config.checkpoint.every = 2, 1
  config.data.synth_train, config.data.synth_eval = 32, 4
  config.eval.every, config.eval.prompts, config.eval.samples_per_prompt = 0, 4, 1
  config.rl.prompts_per_step, config.rl.responses_per_prompt = 2, 2
  config.rl.reward.fn = "random"  # random weights earn no reward: a coin gives a gradient
  workdir = str(tmp_path / "run")
  loop.run(config, workdir)

  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  del saved["eval"]["reward"]  # a run from before the field existed
  (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
  assert export.export(workdir, str(tmp_path / "last"), dtype="float32") == 2
  assert export.export(workdir, str(tmp_path / "one"), step=1, dtype="float32") == 1
  last, one = _tensors(tmp_path / "last"), _tensors(tmp_path / "one")
  assert last.keys() == one.keys()
  assert any(not np.array_equal(last[k], one[k]) for k in last)  # step 2 changed something
  names = {p.name for p in (tmp_path / "last").iterdir()}
  assert {"config.json", "tokenizer.json", "preprocessor_config.json"} <= names

  hf, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
    tmp_path / "last", dtype=torch.float32, output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  for name, tensor in hf.state_dict().items():  # what transformers read is what we wrote
    if name in last:
      np.testing.assert_array_equal(tensor.numpy(), last[name], err_msg=name)
  # What we wrote is the policy: transformers' logits equal the restored policy's.
  ids = np.random.default_rng(0).integers(0, 400, 24)
  with torch.no_grad():
    want = hf.eval()(input_ids=torch.tensor(ids[None])).logits[0].numpy()
  with export.restored_policy(workdir) as (policy, step, _):
    assert step == 2
    model = nnx.merge(policy.graphdef, policy.state.params)
    row = inputs.pack_row([inputs.sequence_from_tokens(ids, [], model.cfg)], model.cfg)
    got = np.asarray(jax.device_get(model.logits(row)))[0, : len(ids)]
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

  with pytest.raises(SystemExit, match="exists"):
    export.main([workdir, str(tmp_path / "last")])
  with pytest.raises(SystemExit, match=r"config\.json not found"):
    export.main([str(tmp_path), str(tmp_path / "nowhere")])
