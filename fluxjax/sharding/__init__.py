"""Mesh, logical axis rules, sequence-parallel strategies, balancing."""
