"""The round as Dagster assets: the thin layer over ``core.loop.round``."""
