"""The round as Dagster assets: the thin layer over ``core.decision_loop`` (noise_floor, before_training, candidate, promotion_decision)."""
