"""Agents in environments as Dagster assets: one agent's evaluation per (dataset version, agent) partition."""
