"""The round as Dagster assets: the thin layer over ``core.loop`` (steps, candidate, decide, setup)."""
