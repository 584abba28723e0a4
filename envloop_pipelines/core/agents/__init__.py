"""Agents in environments: an OpenAI-compatible agent acts in a sandboxed episode, the verifier judges.

* :mod:`.client`: the agent's endpoint (OpenAI-compatible chat with tools, or a Jev API decision endpoint).
* :mod:`.runner`: one attempt (the tool-call loop, bounded turns, tokens and wall time) and its replay.
* :mod:`.attempts`: the attempt record with its full chat transcript, stored as JSONL.
* :mod:`.stats`: pass@1 and pass@k with confidence intervals over environments.
* :mod:`.evaluate`: K attempts per environment of a dataset, the summary, the stored run and MLflow.
"""
