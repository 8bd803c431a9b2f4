"""RL algorithms, rewards, tail batching, async control, coordinator."""
