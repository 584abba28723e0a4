"""The ledger and what every loop records: hypotheses, gates, events, the holdout slot and test-read budget (``ledger``), the loop's files (``store``), the noise floor and the promotion gate (``promotion``), the loop's settings (``loop_config``) and its budget (``loop_budget``).

Below the verifier (``core/verify`` opens the task's own ledger for every hidden read) and below both wings; it imports neither.
"""
