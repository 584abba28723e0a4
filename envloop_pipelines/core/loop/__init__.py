"""The loop's rules: its settings (``config``: ``LoopConfig``), its budget (``budget``: rounds, patience, wall time), the noise floor and the promotion decision (``promotion``) and one round of a task at a time (``round_claim``).

Above the ledger, whose events and hypotheses these rules read and write, and below the verifier and both wings.
"""
