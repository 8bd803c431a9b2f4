"""bench/learning.py's runs: each arm's config overrides, and the figures each
run keeps."""

Arms = dict[str, dict[str, object]]  # arm -> its config overrides

_NO_TAIL: dict[str, object] = {"rollout.tail_batching.eta": 1.0}
PARITY: Arms = {
  "sync": _NO_TAIL,
  "recycle": {},
  "fixed2": {"coordinator.lag.mode": "fixed", "coordinator.lag.fixed_lag": 2},
  "adaptive": {"coordinator.lag.mode": "adaptive"},
}
_STALE: dict[str, object] = {
  **_NO_TAIL,
  "coordinator.lag.mode": "fixed",
  "coordinator.lag.fixed_lag": "{stale_lag}",
}
STRESS: Arms = {
  "sync": PARITY["sync"],
  "stale": _STALE,
  "stale_w1": {**_STALE, "rl.is_mode": "off"},
  "stale_mask": {**_STALE, "rl.is_mode": "mask"},
  "stale_coupled": {**_STALE, "rl.prox": "batch"},
}
# The arms of --runs speed; "{lag}" is --lag.
SPEED: Arms = {
  "sync": _NO_TAIL,
  "tail": {},
  "lag": {**_NO_TAIL, "coordinator.lag.mode": "fixed", "coordinator.lag.fixed_lag": "{lag}"},
  "tail_lag": {"coordinator.lag.mode": "fixed", "coordinator.lag.fixed_lag": "{lag}"},
  "adaptive": {"coordinator.lag.mode": "adaptive"},
}
# The loss normalizers (rl.loss_agg_mode) on the default job, token-mean (the
# default) the baseline.
NORMALIZER: Arms = {
  "token_mean": {},
  "seq_mean_token_mean": {"rl.loss_agg_mode": "seq-mean-token-mean"},
  "token_sum_norm": {"rl.loss_agg_mode": "token-sum-norm"},
}
# The adaptive controller started far from its setpoint, below and above it.
CONTROLLER: Arms = {
  f"from_{ratio}": {"coordinator.lag.mode": "adaptive", "coordinator.lag.initial_ratio": ratio}
  for ratio in (0.1, 0.9)
}
# name: (arms, overrides every arm adds); the first arm is the baseline of each.
PAIRED: dict[str, tuple[Arms, dict[str, object]]] = {
  "parity": (PARITY, {}),
  "stress": (STRESS, {"coordinator.response_records": True}),
  "speed": (SPEED, {}),
  "normalizer": (NORMALIZER, {}),
}
# The rollout/* figures each run keeps per step (item: the response lengths'
# tail and how often the policy reasons).
PER_STEP = ("response_len_p50", "response_len_p99", "reasoning_share")
# The staleness signal's terms (async_control.combine_staleness).
STALENESS_TERMS = ("staleness_kl", "staleness_iw", "staleness_gap")
# The async/* figures each run keeps per step: what the controller saw and set,
# the admitted gap and the barriers (so the barrier tables read from the JSON).
PER_STEP_ASYNC = (
  "async_ratio",
  "staleness",
  "staleness_ema",
  "allowed_lag",
  "trained_gap",
  "version_gap",
  "sync_barrier",
  "interval_barriers_total",
  "hard_bound_barriers_total",
  *STALENESS_TERMS,
)
# The controller is judged on the steps after this one (issue: 90% in band).
SETTLE_STEPS = 20
# Where a step's time goes, each run's mean over its steps 2.. (docs/metrics.md).
PHASES = ("perf/step_seconds", "rollout/wait_seconds", "perf/update_seconds", "publish/seconds")
# Time to accuracy is the time to this share of the baseline's mean final gain.
GAIN_SHARE = 0.9

CONTROLS: Arms = {
  "default": {},
  "reversed": {"rl.reward.fn": "accuracy_reversed"},
  "zeroed": {"rl.reward.fn": "constant"},
  "blind": {"data.blind": True},
  "random_reward": {"rl.reward.fn": "random"},
  # `format` is an ordinary reward, not a registered control, so the run's
  # evaluation is told to score accuracy.
  "format_only": {"rl.reward.fn": "format", "eval.reward": "accuracy"},
  # The RL-start model decoded at a lower temperature (and greedily): what
  # sharpening alone gives, without any RL step.
  "sharpen": {"total_steps": 0, "rl.temperature": 0.5},
}
