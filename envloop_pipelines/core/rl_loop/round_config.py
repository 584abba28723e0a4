"""The RL round's settings: one frozen value, the only place they are declared.

Dagster's ``rl`` resource (``resources/rl.py``) is generated from the fields of
:class:`RlRoundConfig` (same names, defaults and help), so the launch config of an RL
round cannot drift from the core. Every field is a plain value (text, number, flag):
the recipe is a file, the gate is its two knobs, and each cap on tokens says what it
caps (``attempt_tokens``: one attempt, all its model calls; ``completion_tokens``: one
completion of the served policy).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from envloop_pipelines.core.loop.config import CONTAMINATION_POLICIES, LoopConfig

#: What an RL round measures and gates on: held-out pass@1 (``Gate.primary_metric``).
RL_METRIC = "pass_at_1"
#: The change kind an RL round registers (``Hypothesis.change["kind"]``).
CHANGE_KIND = "rl_from_verified_attempts"
#: The confidence level of the held-out comparison's CIs (the gate's CI above zero is at this level).
CONFIDENCE_LEVEL = 0.95
DEFAULT_RL_RECIPE = "packaged:causal_sft_qwen_gpu.yaml"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class RlRoundConfig:
    """What a person chooses for an RL round; the rest comes from the causal-SFT recipe file."""

    dataset: str = field(default="", metadata=_help(
        "The environment dataset, <name>@<version> (envloop env list), split train / heldout."))
    task: str = field(default="", metadata=_help("The loop's name (ledger, MLflow experiment); empty: rl-<dataset name>."))
    recipe: str = field(default=DEFAULT_RL_RECIPE, metadata=_help(
        "The causal-SFT recipe: packaged:<file> or a path (its base_model is the policy's base)."))
    sampler_url: str | None = field(default=None, metadata=_help(
        "An OpenAI-compatible agent that samples the training attempts; unset: the current policy, served."))
    sampler_model: str | None = field(default=None, metadata=_help("The sampler's model name (with sampler_url)."))
    sampler_key_env: str | None = field(default=None, metadata=_help("The variable holding the sampler's bearer key."))
    attempts: int = field(default=4, metadata=_help("K, sampled attempts per training environment."))
    eval_attempts: int = field(default=4, metadata=_help("Attempts per held-out environment and arm in the re-evaluation."))
    noise_arms: int = field(default=2, metadata=_help("Null arms of the noise floor (≥ 2)."))
    predicted_delta: float = field(default=0.05, metadata=_help("The registered prediction of the held-out pass@1 gain."))
    min_delta: float = field(default=0.0, metadata=_help("The gate's minimum paired delta of pass@1."))
    floor_multiplier: float = field(default=1.0, metadata=_help("The gate's multiple of the noise floor (≥ 1)."))
    max_turns: int = field(default=8, metadata=_help("Model calls per attempt."))
    attempt_tokens: int = field(default=2048, metadata=_help("Completion tokens per attempt, over all its model calls."))
    wall_s: float = field(default=300.0, metadata=_help("Seconds per attempt."))
    completion_tokens: int = field(default=512, metadata=_help("The served policy's cap on one completion."))
    workers: int = field(default=2, metadata=_help("Attempts run side by side (each in its own sandbox)."))
    contamination_policy: str = field(default="remove", metadata=_help(
        "remove: drop SFT rows that touch the held-out environments; refuse: stop the round."))
    bootstrap_seed: int = field(default=0, metadata=_help("The seed of the held-out comparison's bootstrap."))
    home: str | None = field(default=None, metadata=_help("The EnvLoop home (default $ENVLOOP_HOME or ./.envloop)."))

    def __post_init__(self) -> None:
        for name in ("attempts", "eval_attempts", "max_turns", "attempt_tokens", "completion_tokens", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RlRoundConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.noise_arms, bool) or not isinstance(self.noise_arms, int) or self.noise_arms < 2:
            raise ValueError(f"RlRoundConfig.noise_arms must be ≥ 2 (a spread needs two arms), got {self.noise_arms!r}")
        if not self.wall_s > 0:
            raise ValueError(f"RlRoundConfig.wall_s must be a positive number of seconds, got {self.wall_s!r}")
        if self.contamination_policy not in CONTAMINATION_POLICIES:
            raise ValueError(f"RlRoundConfig.contamination_policy must be one of {CONTAMINATION_POLICIES}, "
                             f"got {self.contamination_policy!r}")
        if (self.sampler_url is None) != (self.sampler_model is None):
            raise ValueError("RlRoundConfig.sampler_url and sampler_model go together (or neither: the current "
                             "policy samples)")
        if not self.task:
            if not self.dataset:
                raise ValueError("RlRoundConfig: give the dataset (<name>@<version>) or the task")
            object.__setattr__(self, "task", f"rl-{self.dataset.split('@')[0]}")

    def load_recipe(self) -> Any:
        """The causal-SFT recipe (``CausalSftRecipe``) the file names, validated."""
        from envloop_pipelines.core.model.causal_sft import CausalSftRecipe
        from envloop_pipelines.core.model.recipe import load_recipe

        return load_recipe(self.recipe, kind=CausalSftRecipe)

    def gate(self) -> Any:
        """The gate the round registers (``Gate`` on :data:`RL_METRIC`)."""
        from envloop_pipelines.core.ledger.hypothesis import Gate

        return Gate(primary_metric=RL_METRIC, min_delta=self.min_delta, floor_multiplier=self.floor_multiplier)

    def limits(self) -> Any:
        """Each attempt's bounds (``AttemptLimits``)."""
        from envloop_pipelines.core.agents.runner import AttemptLimits

        return AttemptLimits(max_turns=self.max_turns, max_tokens=self.attempt_tokens, wall_s=self.wall_s,
                             request_timeout_s=min(120.0, self.wall_s))

    def sampler(self) -> Any:
        """The agent that samples (``AgentSpec``), or ``None``: the current policy, served."""
        if self.sampler_url is None:
            return None
        from envloop_pipelines.core.agents.client import AgentSpec

        return AgentSpec(self.sampler_url, self.sampler_model or "", api_key_env=self.sampler_key_env)

    def loop_config(self) -> LoopConfig:
        """The loop settings the shared MLflow helpers read (the task and the home)."""
        return LoopConfig(task=self.task, home=self.home)

    def to_settings(self) -> dict[str, Any]:
        """JSON-able settings (what :meth:`from_settings` reads back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_settings(cls, settings: typing.Mapping[str, Any]) -> "RlRoundConfig":
        """A config from settings.

        Raises:
            ValueError: an unknown setting (naming the allowed ones) or a bad value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"unknown RL round setting(s) {unknown}; allowed: {sorted(names)}")
        return cls(**dict(settings))


__all__ = ["CHANGE_KIND", "CONFIDENCE_LEVEL", "DEFAULT_RL_RECIPE", "RL_METRIC", "RlRoundConfig"]
