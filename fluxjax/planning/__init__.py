"""Sequence planning on host numpy from lengths alone: plans, planners, the cost model."""
