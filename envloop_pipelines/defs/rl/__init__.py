"""RL from verified attempts as Dagster assets: one RL round per partition of ``rl_rounds``."""
