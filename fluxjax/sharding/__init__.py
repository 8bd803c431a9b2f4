"""Mesh, logical-axis rules, plans, planners and the balance cost model."""
