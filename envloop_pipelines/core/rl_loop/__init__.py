"""The RL loop: a round of RL from verified attempts, its steps (``round_steps``) and their typed records (``step_records``), its settings (``round_config``), the SFT snapshot (``sft_snapshot``) and the whole round without Dagster (``run_round``). The policy server is passed in by the caller; this package never imports ``core/serve``.
"""
