"""The round as Dagster assets: the thin layer over ``core.decision_loop`` (one module per asset, named after it)."""
