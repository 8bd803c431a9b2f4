"""Flux adaptive async: version tags, the staleness metric, the async controller, admission.

Entry points: `combine_staleness` (the controller's signal), `AsyncController` (EMA and
PID on a continuous async ratio, band, sync barriers; `DesignController` is the design's
update as written, to measure against) and `AdmissionController` (at most
(step + lag + 1) * B rollouts started after `step` updates; modes sync, fixed, adaptive).
The mechanism and the deviations from the Flux design, and why, are told in
docs/training-loop.md, "The adaptive async controller".
"""

from __future__ import annotations

import math

import numpy as np

from fluxjax import settings as settings_lib

# --- per-token version tags ---------------------------------------------------------


def parse_version(weight_version: str | int) -> int:
  """The integer policy version of a backend's weight_version string.

  The coordinator publishes weights as str(step); the engine's initial
  "default" counts as version 0.
  """
  try:
    return int(weight_version)
  except (TypeError, ValueError):
    return 0


def token_versions(completion, launch_version: int) -> list[int]:
  """The policy version of each token of a `protocol.Completion`; tokens the
  backend reported none for were sampled by `launch_version`, the version
  its round was admitted against."""
  return [parse_version(v) for v in completion.versions(default=str(launch_version))]


def tag_tokens(num_tokens: int, version: int, tags_T: np.ndarray | None = None) -> np.ndarray:
  """Appends `num_tokens` tags of `version` to `tags_T` (a new array).

  A response resumed after a weight update (partial rollout) is tagged in
  segments, one call per segment.
  """
  new = np.full(num_tokens, version, np.int32)
  return new if tags_T is None else np.concatenate([np.asarray(tags_T, np.int32), new])


def version_gap(tags_T, current_version: int) -> dict:
  """Mean and max of current_version - tag over the tokens."""
  gap = current_version - np.asarray(tags_T, np.float64)
  if gap.size == 0:
    return {"mean": 0.0, "max": 0.0}
  return {"mean": float(gap.mean()), "max": float(gap.max())}


def admission_gap(tags_T, launch_T, current_version: int) -> dict:
  """The version gap admission controls: `version_gap` with each token's tag
  raised to the launch version of the round that produced its response.

  A response cut at a round's end is continued by a later round (recycling);
  its earlier tokens are older than that round's launch by however many
  rounds it waited, whatever the lag. Admission decides only when the round
  that finished it started, so the controller is charged from there.
  """
  tags = np.maximum(np.asarray(tags_T, np.int64), np.asarray(launch_T, np.int64))
  return version_gap(tags, current_version)


def batch_gaps(responses, current_version: int) -> tuple[dict, dict]:
  """The version gap of every token of a batch's `responses` ((completion,
  the launch version of its round) pairs) against `current_version`: in
  full (`version_gap`) and as admission sees it (`admission_gap`)."""
  tags, launches = [], []
  for completion, launch_version in responses:
    versions = token_versions(completion, launch_version)
    tags += versions
    launches += [launch_version] * len(versions)
  trained = version_gap(np.asarray(tags), current_version)
  return trained, admission_gap(tags, launches, current_version)


# --- the staleness metric -----------------------------------------------------------


def combine_staleness(
  gap_mean: float,
  gap_max: float,
  kl: float,
  iw_var: float,
  lag: settings_lib.Lag,
) -> dict:
  """The staleness from its three signals (already reduced over tokens), in
  [0, 1] as Flux combines them with `lag`'s weights and normalizers:

    s = clip(kl_weight * kl / kl_normalizer
             + iw_weight * log1p(iw_var) / iw_normalizer
             + gap_weight * gap_mean / max_version_gap, 0, 1).

  A normalizer is the value of its signal that counts as fully stale.
  The train step reduces KL and the weight moments on device (loss metrics
  `behaviour_kl`, `behaviour_w`, `behaviour_w_sq`: rl/losses.py,
  `behaviour_drift`), so the coordinator combines those here instead of
  fetching per-token arrays. A non-finite signal counts
  as 0 and a negative one (rounding in E[w^2] - E[w]^2) as 0. The three
  terms before the clip come back as `staleness_kl`, `staleness_iw` and
  `staleness_gap`: which of them drives the controller.
  """
  m = lag

  def clean(x: float) -> float:
    return float(x) if math.isfinite(x) and x > 0 else 0.0

  terms = {
    "staleness_kl": m.kl_weight * clean(kl) / m.kl_normalizer,
    "staleness_iw": m.iw_weight * math.log1p(clean(iw_var)) / m.iw_normalizer,
    "staleness_gap": m.gap_weight * clean(gap_mean) / m.max_version_gap,
  }
  return {
    "staleness": min(max(sum(terms.values()), 0.0), 1.0),
    **terms,
    "version_gap": float(gap_mean),
    "version_gap_max": float(gap_max),
    "kl": float(kl),
    "iw_var": float(iw_var),
  }


def trained_staleness(gap: dict, train: dict[str, float], lag: settings_lib.Lag) -> dict:
  """`combine_staleness` of a trained batch: its admitted `gap`
  (`admission_gap`) and the train step's token means of the behaviour KL and
  the trainer-to-behaviour weights, Var(w) = E[w^2] - E[w]^2."""
  iw_var = max(train.get("behaviour_w_sq", 1.0) - train.get("behaviour_w", 1.0) ** 2, 0.0)
  return combine_staleness(gap["mean"], gap["max"], train.get("behaviour_kl", 0.0), iw_var, lag)


# --- the async controller -----------------------------------------------------------


def check_lag(lag: settings_lib.Lag) -> None:
  """The `coordinator.lag` section's own rules, whatever its mode.

  Raises:
    ValueError: a rule broken, naming its fields.
  """
  if lag.controller not in CONTROLLERS:
    raise ValueError(
      f"coordinator.lag.controller must be one of {tuple(CONTROLLERS)}, got {lag.controller!r}"
    )
  if not 0 <= lag.min_async_ratio <= lag.initial_ratio <= lag.max_async_ratio <= 1:
    raise ValueError(
      "coordinator.lag needs 0 <= min_async_ratio <= initial_ratio <= max_async_ratio <= 1"
    )
  if not 0 <= lag.min_lag <= lag.max_lag:
    raise ValueError("coordinator.lag needs 0 <= min_lag <= max_lag")
  if lag.tolerance < 0 or lag.hard_bound < lag.target_staleness + lag.tolerance:
    raise ValueError("coordinator.lag needs tolerance >= 0 and hard_bound >= target + tolerance")
  if min(lag.kp, lag.ki, lag.kd) < 0 or lag.max_step <= 0:
    raise ValueError("coordinator.lag needs kp, ki, kd >= 0 and max_step > 0")
  if not 0 <= lag.ema_decay < 1 or lag.sync_interval < 0:
    raise ValueError("coordinator.lag needs 0 <= ema_decay < 1 and sync_interval >= 0")
  if min(lag.kl_weight, lag.iw_weight, lag.gap_weight) < 0:
    raise ValueError("coordinator.lag staleness weights must be >= 0")
  if min(lag.kl_normalizer, lag.iw_normalizer, lag.max_version_gap) <= 0:
    raise ValueError("coordinator.lag.kl_normalizer, iw_normalizer and max_version_gap must be > 0")


class AsyncController:
  """The Flux adaptive async controller: staleness EMA -> PID steps on the async ratio.

  `update` is called once per training step with that step's staleness and
  moves the EMA and the ratio; `barrier_due` then says whether a sync
  barrier is due, and why. The barrier itself (holding the lag at 0 through
  a drain and while the EMA is above the hard bound) is the admission
  controller's. `track` moves the EMA alone (the other modes' metric).
  Its settings are the `coordinator.lag` section's (`check_lag` holds them
  to its rules).
  """

  def __init__(self, lag: settings_lib.Lag):
    check_lag(lag)
    self.lag = lag
    self.ratio = lag.initial_ratio
    self.ema = lag.target_staleness
    self.integral = 0.0
    self.prev_error: float | None = None
    self.last_sync = 0  # the step of the last completed sync (training starts synced)
    self.bound_armed = True  # False from a hard-bound barrier until the EMA is back under

  @property
  def continuous_lag(self) -> float:
    c = self.lag
    return c.min_lag + self.ratio * (c.max_lag - c.min_lag)

  def error(self) -> float:
    """target - ema."""
    return self.lag.target_staleness - self.ema

  def track(self, staleness_value: float) -> float | None:
    """Folds one staleness into the EMA; returns it clipped to [0, 1]. A
    non-finite one is skipped (None): it must not poison the EMA or the
    integral."""
    if not math.isfinite(staleness_value):
      return None
    s = min(max(float(staleness_value), 0.0), 1.0)
    self.ema = self.lag.ema_decay * self.ema + (1 - self.lag.ema_decay) * s
    return s

  @property
  def above_bound(self) -> bool:
    """The EMA is above the hard bound: no admission ahead of the trainer."""
    return self.ema > self.lag.hard_bound

  def update(self, staleness_value: float) -> None:
    """One control step after a training step: the EMA and the ratio move."""
    c = self.lag
    s = self.track(staleness_value)
    if s is not None:
      e = self.error()
      if e * (c.target_staleness - s) >= 0:
        self._pid_step(e)
      else:  # this batch is already on the other side of the target: hold
        self.prev_error = e

  def barrier_due(self, step: int) -> str | None:
    """The cause of a sync barrier due after training step `step`:
    "interval" (sync_interval steps since the last one), "hard_bound" (the
    EMA has just gone above it), or None."""
    c = self.lag
    fire, self.bound_armed = self.above_bound and self.bound_armed, not self.above_bound
    if c.sync_interval > 0 and step - self.last_sync >= c.sync_interval:
      return "interval"
    return "hard_bound" if fire else None

  def _pid_step(self, e: float) -> None:
    c = self.lag
    d = 0.0 if self.prev_error is None else e - self.prev_error
    self.prev_error = e
    if abs(e) <= c.tolerance:
      return  # inside the band: hold the ratio, freeze the integral
    if self.integral * e < 0:
      self.integral = 0.0  # the error changed sign: the old integral pushes the wrong way
    cap = c.max_step / c.ki if c.ki > 0 else 0.0
    integral = min(max(self.integral + e, -cap), cap)
    raw = c.kp * e + c.ki * integral + c.kd * d
    at_bound = (self.ratio >= c.max_async_ratio and e > 0) or (
      self.ratio <= c.min_async_ratio and e < 0
    )
    if at_bound or (abs(raw) > c.max_step and raw * e > 0):
      # Conditional integration: the output is saturated in the error's direction.
      integral = self.integral
      raw = c.kp * e + c.ki * integral + c.kd * d
    self.integral = integral
    step = min(max(raw, -c.max_step), c.max_step)
    self.ratio = min(max(self.ratio + step, c.min_async_ratio), c.max_async_ratio)

  def get_state(self) -> dict:
    return {
      "ratio": self.ratio,
      "ema": self.ema,
      "integral": self.integral,
      "prev_error": self.prev_error,
      "last_sync": self.last_sync,
      "bound_armed": self.bound_armed,
    }

  def set_state(self, state: dict) -> None:
    self.ratio = float(state["ratio"])
    self.ema = float(state["ema"])
    self.integral = float(state["integral"])
    self.prev_error = None if state["prev_error"] is None else float(state["prev_error"])
    self.last_sync = int(state["last_sync"])
    self.bound_armed = bool(state["bound_armed"])


class DesignController(AsyncController):
  """The Flux design's `update` as written, to measure fluxjax's departures
  against (`coordinator.lag.controller=design`): the EMA starts at 0, every
  error is integrated, the whole PID output moves the ratio (no band, no
  hold, no max_step), and a barrier is due on every step the EMA is above
  hard_bound or more than sync_interval steps after the last sync."""

  def __init__(self, lag: settings_lib.Lag):
    super().__init__(lag)
    self.ema = 0.0
    self.prev_error = 0.0

  def update(self, staleness_value: float) -> None:
    c = self.lag
    if self.track(staleness_value) is None:
      return
    e = self.error()
    self.integral += e
    d, self.prev_error = e - (self.prev_error or 0.0), e
    raw = c.kp * e + c.ki * self.integral + c.kd * d
    self.ratio = min(max(self.ratio + raw, c.min_async_ratio), c.max_async_ratio)

  def barrier_due(self, step: int) -> str | None:
    c = self.lag
    if c.sync_interval > 0 and step - self.last_sync > c.sync_interval:
      return "interval"
    return "hard_bound" if self.above_bound else None


# coordinator.lag.controller: fluxjax's, or the design's update as written.
CONTROLLERS: dict[str, type[AsyncController]] = {
  "fluxjax": AsyncController,
  "design": DesignController,
}


def make_controller(lag: settings_lib.Lag) -> AsyncController:
  """The `coordinator.lag.controller` the section names (`check_lag`)."""
  check_lag(lag)
  return CONTROLLERS[lag.controller](lag)


# --- admission ----------------------------------------------------------------------

MODES = ("sync", "fixed", "adaptive")
BARRIER_CAUSES = ("hard_bound", "interval")


class AdmissionController:
  """How many new rollouts may start, given the allowed lag.

  Counts rollouts started (in flight, finished or consumed) since the start of
  training. After `step` updates at most floor((step + lag + 1) * batch_size)
  may have started, so no sample is generated more than ceil(lag) versions
  before the step that consumes it. A fractional lag lets that fraction of the
  next batch start before the update: the mean version gap is the lag. A
  rollout that was aborted and will be re-run is given back with
  `on_cancelled`. A run of `total_steps` starts no rollout for a batch past
  its last step: at most total_steps * batch_size ever start.

  Args:
    batch_size: prompts per training step.
    mode: "sync", "fixed" or "adaptive".
    fixed_lag: the lag in fixed mode.
    controller: the async controller (adaptive mode).
    total_steps: the run's last step (None: no end).
  """

  def __init__(
    self,
    batch_size: int,
    mode: str,
    *,
    fixed_lag: int | None = None,
    controller: AsyncController | None = None,
    total_steps: int | None = None,
  ):
    if mode not in MODES:
      raise ValueError(f"coordinator.lag.mode must be one of {MODES}, got {mode!r}")
    if batch_size < 1:
      raise ValueError(f"need batch_size >= 1, got {batch_size}")
    if mode == "fixed" and (fixed_lag is None or fixed_lag < 0):
      raise ValueError(f"fixed mode needs coordinator.lag.fixed_lag >= 0, got {fixed_lag}")
    if mode == "adaptive" and controller is None:
      raise ValueError("adaptive mode needs an AsyncController")
    self.batch_size, self.mode = batch_size, mode
    self.total_steps = total_steps
    self.fixed_lag = fixed_lag
    self.controller = controller
    self.started = 0
    self.last_staleness: float | None = None
    self.barriers = dict.fromkeys(BARRIER_CAUSES, 0)  # forced syncs, by cause
    # The most rollouts any answer of `capacity` has allowed: what may start
    # on a grant made before a barrier, whenever the producer acts on it.
    self._granted = 0
    # While a barrier holds: the first batch no earlier grant reaches.
    self._sync_until: int | None = None

  @classmethod
  def from_config(
    cls, lag: settings_lib.Lag, batch_size: int, total_steps: int | None = None
  ) -> AdmissionController:
    """From the `coordinator.lag` section (held to its rules in every mode)."""
    return cls(
      batch_size,
      lag.mode,
      fixed_lag=lag.fixed_lag,
      controller=make_controller(lag),
      total_steps=total_steps,
    )

  @property
  def forced_syncs(self) -> int:
    """Sync barriers forced so far, whatever the cause."""
    return sum(self.barriers.values())

  @property
  def syncing(self) -> bool:
    """A forced sync barrier holds the lag at 0 (adaptive mode)."""
    return self._sync_until is not None

  @property
  def allowed_lag(self) -> float:
    """The lag in force (adaptive: from the async ratio; 0 during a barrier)."""
    if self.mode == "sync":
      return 0.0
    if self.mode == "fixed":
      assert self.fixed_lag is not None
      return float(self.fixed_lag)
    assert self.controller is not None
    return 0.0 if self.syncing else self.controller.continuous_lag

  @property
  def max_gap(self) -> int:
    """The most whole versions an admitted sample may trail the policy that
    trains it: 0 in sync, fixed_lag, ceil(max_lag) adaptive."""
    if self.mode == "sync":
      return 0
    if self.mode == "fixed":
      assert self.fixed_lag is not None
      return self.fixed_lag
    assert self.controller is not None
    return math.ceil(self.controller.lag.max_lag)

  def capacity(self, current_step: int) -> int:
    """How many rollouts may start after `current_step` updates (never negative)."""
    steps = current_step + self.allowed_lag + 1
    if self.total_steps is not None:
      steps = min(steps, self.total_steps)
    limit = math.floor(steps * self.batch_size + 1e-9)
    self._granted = max(self._granted, limit)
    return max(0, limit - self.started)

  def on_started(self, n: int = 1) -> None:
    self.started += n

  def on_cancelled(self, n: int = 1) -> None:
    self.started = max(0, self.started - n)

  def observe(self, staleness_value: float, step: int) -> dict:
    """Feeds the staleness of the batch that update `step` trained.

    Returns the control metrics for the step: allowed_lag (for what follows),
    the barrier counts by cause (`<cause>_barriers_total`), staleness_ema
    where there is a controller, and in adaptive mode async_ratio and
    sync_barrier (1 while a barrier holds the lag at 0).
    """
    self.last_staleness = float(staleness_value)
    ctl = self.controller
    out: dict[str, float] = {}
    if self.mode == "adaptive":
      assert ctl is not None
      ctl.update(staleness_value)
      if self._sync_until is not None and step >= self._sync_until and not ctl.above_bound:
        # Drained, and the EMA back under the hard bound: the next batch is
        # admitted, and trained, at this version.
        self._sync_until = None
        ctl.last_sync = step
      cause = ctl.barrier_due(step)
      if cause is not None and not self.syncing:
        # Hold lag 0 until every batch an earlier grant reaches has trained.
        granted = max(self._granted, self.started)
        self._sync_until = max(-(-granted // self.batch_size), step + 1)
        self.barriers[cause] += 1
      out |= {"async_ratio": ctl.ratio, "sync_barrier": float(self.syncing)}
    elif ctl is not None:
      ctl.track(staleness_value)
    if ctl is not None:
      out["staleness_ema"] = ctl.ema
    out |= {f"{cause}_barriers_total": float(n) for cause, n in self.barriers.items()}
    return {"allowed_lag": self.allowed_lag, **out}

  def get_state(self) -> dict:
    return {
      "mode": self.mode,
      "started": self.started,
      "last_staleness": self.last_staleness,
      "barriers": dict(self.barriers),
      "granted": self._granted,
      "sync_until": self._sync_until,
      "controller": None if self.controller is None else self.controller.get_state(),
    }

  def set_state(self, state: dict) -> None:
    self.started = int(state["started"])
    self.last_staleness = state.get("last_staleness")
    if "controller" not in state:
      return  # a state without the controller's part: it starts afresh
    self.barriers = {cause: int(state["barriers"][cause]) for cause in BARRIER_CAUSES}
    self._granted = int(state["granted"])
    self._sync_until = None if state["sync_until"] is None else int(state["sync_until"])
    if self.controller is not None and state["controller"] is not None:
      self.controller.set_state(state["controller"])
