"""The built-in personal-agent decision benchmark (``docs/decision-data.md``).

Users with latent personal rules, seven families of questions about an agent's
pending action, labels that follow exactly from the rules, three hard variants
(override, removed, buried) and two renderers. Pure Python and numpy.

Example::

    from envloop_pipelines.core.benchmark import BenchmarkConfig, generate_benchmark, write_jsonl

    records = generate_benchmark(BenchmarkConfig())
    digest = write_jsonl(records, "personal_agent.jsonl")
"""

from .generator import (
    BENCHMARK_NAME,
    BUILTIN_HIDDEN_USERS,
    FAMILIES,
    GENERATOR_VERSION,
    SAFETY_FAMILIES,
    SOURCE,
    SYNTHESIZED_SOURCE,
    VARIANTS,
    BenchmarkConfig,
    VariantMix,
    benchmark_version,
    describe,
    generate_benchmark,
    generate_targeted,
    jsonl_bytes,
    user_ids,
    users_for,
    users_for_records,
    write_jsonl,
)
from .labels import (
    FAMILY_TYPES,
    LABEL_FUNCTIONS,
    SOFT_LABEL_FUNCTIONS,
    derive_label,
    label_apply_memory,
    label_forgotten_violation,
    label_needs_approval,
    label_notify_level,
    label_pick_option,
    label_route,
    label_share_ok,
)
from .render import RENDERERS, render_state
from .scenarios import CELLS, FAMILY_RULE_KINDS, RULE_KINDS
from .users import UserRules, make_user

__all__ = [
    "BENCHMARK_NAME",
    "BUILTIN_HIDDEN_USERS",
    "BenchmarkConfig",
    "CELLS",
    "FAMILIES",
    "FAMILY_RULE_KINDS",
    "FAMILY_TYPES",
    "GENERATOR_VERSION",
    "LABEL_FUNCTIONS",
    "RENDERERS",
    "RULE_KINDS",
    "SAFETY_FAMILIES",
    "SOFT_LABEL_FUNCTIONS",
    "SOURCE",
    "SYNTHESIZED_SOURCE",
    "UserRules",
    "VARIANTS",
    "VariantMix",
    "benchmark_version",
    "derive_label",
    "describe",
    "generate_benchmark",
    "generate_targeted",
    "jsonl_bytes",
    "label_apply_memory",
    "label_forgotten_violation",
    "label_needs_approval",
    "label_notify_level",
    "label_pick_option",
    "label_route",
    "label_share_ok",
    "make_user",
    "render_state",
    "user_ids",
    "users_for",
    "users_for_records",
    "write_jsonl",
]
