"""Decision metrics, by idea: every evaluation, check and release card reads its numbers from here.

- ``batch``: predictions as one validated, padded batch (ragged probability vectors, hard and soft labels).
- ``point``: point metrics of one model (accuracy, family-macro accuracy, Brier, NLL, ECE, coverage at an
  error budget, AURC, false-negative rates, ``summarize``).
- ``paired``: paired statistics of two models on the same questions (``paired_delta`` with a record-clustered
  bootstrap CI, ``minimum_detectable_effect``).

Import each name from the module that defines it; this package re-exports nothing.
"""
