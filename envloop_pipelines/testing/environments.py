"""Environment specs for the agent tests and ``bench/bench_agents.py``: the shell families and a decision question."""

from __future__ import annotations

from dataclasses import dataclass

from envloop_pipelines.core.environments.shell import shell_spec
from envloop_pipelines.core.environments.spec import EnvironmentSpec, VerifierSpec
from envloop_pipelines.core.storage import canonical_json, sha256_bytes


def shell_env(seed: int, *, split: str = "train") -> EnvironmentSpec:
    """The shell family's task for ``seed`` as a terminal environment (terminal-state check)."""
    s = shell_spec(seed)
    return EnvironmentSpec(id=f"shell/{seed:04d}", kind="terminal", instruction=s.prompt, files=dict(s.files),
                           verifier=VerifierSpec("terminal", dict(s.check_params)), seed=seed, split=split,
                           meta={"family": s.family})


def decision_env(label: int = 0, *, env_id: str = "decision/route-0") -> EnvironmentSpec:
    """A choice question (billing / shipping / other) whose right answer is option ``label``."""
    keys = ["billing", "shipping", "other"]
    return EnvironmentSpec(
        id=env_id, kind="decision", instruction="Which team should handle this ticket?",
        question={"state_text": "I was charged twice for my order.", "instructions_text": "Which team should handle this?",
                  "option_keys": keys, "option_texts": ["Charges and refunds", "Deliveries", None], "type": "choice"},
        verifier=VerifierSpec("rule", {"label": {"record_id": "r1", "question_id": "route", "family": "route",
                                                 "type": "choice", "option_keys": keys, "label": label,
                                                 "soft_label": None}}))



@dataclass(frozen=True)
class SpecSet:
    """A named, versioned set of specs held in memory: what ``evaluate_agent`` needs of a dataset."""

    name: str
    environments: tuple[EnvironmentSpec, ...]

    @property
    def version(self) -> str:
        return sha256_bytes(canonical_json([e.fingerprint() for e in self.environments]))


def spec_set(name: str, specs: list[EnvironmentSpec]) -> SpecSet:
    """The specs as a :class:`SpecSet` named ``name``."""
    return SpecSet(name, tuple(specs))
