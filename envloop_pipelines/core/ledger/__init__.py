"""The ledger and what every loop records: hypotheses, gates, events, the holdout slot and test-read budget (``ledger``), the loop's files (``store``), the chain head anchored in MLflow (``anchor``) and MLflow's champion alias as the ledger's projection (``projection``).

Below the verifier (``core/verify`` opens the task's own ledger for every hidden read) and below both wings; it imports neither.
"""
