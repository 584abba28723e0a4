"""Publishing: the one holdout read, the registered model version, the champion alias and the card (``publish``, ``card``), and the round's tracked runs and verifier calls (``tracked_runs``).

Above the verifier, below both wings: what the decision loop and the RL loop share beyond the ledger.
"""
