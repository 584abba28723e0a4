"""The ledger and what every loop records: the ledger itself, its hypotheses, amendments and releases (``ledger``), its hash-chained events and their kinds (``event_log``), hypotheses, gates and their checks (``hypothesis``), the holdout slot and test-read budget (``reads``), the loop's files (``store``), the chain head anchored in MLflow (``anchor``) and MLflow's champion alias as the ledger's projection (``projection``).

Inside, imports point down: ``anchor`` → ``ledger`` → ``hypothesis`` and ``reads`` → ``event_log`` → ``store``.

Below the verifier (``core/verify`` opens the task's own ledger for every hidden read) and below both wings; it imports neither.
"""
