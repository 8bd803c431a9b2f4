"""The reference model of the KL term: which weights, and keeping them over a resume.

The reference is the policy RL starts from, as in veRL and OpenRLHF (their `ref` defaults
to the actor's initial checkpoint), unless `rl.ref_hf_path` names another HF checkpoint
folder (`source`). `reference_params` places its parameters with the policy's shardings
(one more FSDP-sharded copy of the parameters); the stream trainer runs its forward in
the same program as each part's gradients.
"""

from __future__ import annotations

import logging
import os

import jax
from flax import nnx

from fluxjax import settings as settings_lib
from fluxjax.models import hf_export, hf_load
from fluxjax.rl import sft

log = logging.getLogger(__name__)

REFERENCE_DIR = "reference"


def needed(rl: settings_lib.RL) -> bool:
  return bool(rl.kl_coef)


def source(settings: settings_lib.Settings, workdir: str) -> tuple[str, bool]:
  """(folder the reference is read from on a resume, whether a fresh run writes it).

  The reference is, by the run's settings:
    rl.ref_hf_path set          that folder, on a fresh run and on a resume;
    model.hf_path, no warm-up   the policy's own checkpoint: copied on a fresh
                                run, read back from model.hf_path on a resume;
    otherwise                   (a preset, or the SFT warm-up changed the
                                weights) the policy as RL begins, copied and
                                written once to WORKDIR/reference (float32, HF
                                layout) for a resumed run to read back.
  """
  if settings.rl.ref_hf_path:
    return settings.rl.ref_hf_path, False
  if settings.model.hf_path and not sft.runs(settings.sft, settings.total_steps):
    return settings.model.hf_path, False
  return os.path.join(workdir, REFERENCE_DIR), True


def reference_params(
  settings: settings_lib.Settings,
  workdir: str,
  model_cfg,
  graphdef,
  policy_params,
  param_shardings,
  *,
  fresh: bool,
):
  """The reference's parameters, placed like the policy's.

  Args:
    settings: the run's settings (rl.ref_hf_path, model.hf_path, sft).
    workdir: the run's work directory.
    model_cfg: the policy's model config (a reference must share it).
    graphdef, policy_params: the policy as RL begins (used on a fresh run).
    param_shardings: the policy parameters' shardings.
    fresh: a fresh run (RL starts now) rather than a resume.
  """
  path, snapshot = source(settings, workdir)
  if fresh and not settings.rl.ref_hf_path:
    # The policy as RL begins; its own buffers (the update donates the policy's).
    params = jax.tree.map(lambda x: x.copy(), policy_params)
    if snapshot:
      hf_export.save_hf_checkpoint(nnx.merge(graphdef, params), path, dtype="float32")
      log.info("reference model: the policy at the start of RL, saved to %s", path)
    return params
  if not os.path.exists(os.path.join(path, "config.json")):
    raise FileNotFoundError(
      f"the reference model for rl.kl_coef > 0 is read from {path}, which holds no "
      "checkpoint (a run resumed with KL that began without it?); set rl.ref_hf_path"
    )
  shardings = {
    k: v.get_value() if isinstance(v, nnx.Variable) else v
    for k, v in nnx.to_flat_state(param_shardings)
  }
  model = hf_load.load_hf_checkpoint(path, model_cfg, shardings=shardings)
  log.info("reference model: read from %s", path)
  return nnx.state(model, nnx.Param)
