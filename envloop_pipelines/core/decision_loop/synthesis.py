"""Environment synthesis: new training examples aimed at the mined failure clusters.

Every synthesized row carries provenance to the cluster it targets. Two
generators ship, behind one protocol; a user plugs in their own with a
``module:attribute`` spec or the ``envloop.environment_generators`` entry point.
A user's generator is user code: it runs in the sandbox (:class:`SandboxedGenerator`:
another uid, the label folder hidden, the clusters and train rows in as JSON,
rows back as JSON), never in the loop's process, whose user owns the label
files. The two below are this package's code and run in-process:

- :class:`BuiltinTargetedGenerator` (the built-in benchmark): the generator's
  targeted mode, for **new users only**, in the training surface form.
- :class:`VariantGenerator` (imported data): label-preserving variants of
  training questions in the clusters' families: option order permutations,
  negation of noul questions with the label flipped, paraphrase templates, and
  re-weighting (repeats) of similar training examples.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.decision_loop.failure_mining import FailureCluster
from envloop_pipelines.core.data.question_table import QUESTION_SCHEMA, questions_table
from envloop_pipelines.core.data.records import records_from_objects

#: A synthesized or base training row: the question table plus where the row came from.
SNAPSHOT_SCHEMA = QUESTION_SCHEMA.append(pa.field("provenance", pa.string(), nullable=False))
ENTRY_POINT_GROUP = "envloop.environment_generators"


@dataclass(frozen=True)
class SynthesisRequest:
    """What a round asks a generator for."""

    round: str
    clusters: tuple[FailureCluster, ...]
    n_examples: int
    seed: int


class EnvironmentGenerator(Protocol):
    """Makes training rows aimed at failure clusters (``SNAPSHOT_SCHEMA``)."""

    name: str

    def synthesize(self, request: SynthesisRequest, train: pa.Table) -> pa.Table: ...


def allocate(clusters: Sequence[FailureCluster], n_examples: int) -> list[int]:
    """Split ``n_examples`` across clusters in proportion to their excess errors (at least 1 each)."""
    if not clusters or n_examples <= 0:
        return [0] * len(clusters)
    weights = np.array([max(c.excess_errors, 0.0) + 1.0 for c in clusters])
    raw = weights / weights.sum() * n_examples
    counts = np.maximum(np.floor(raw).astype(int), 1)
    while counts.sum() > n_examples and counts.max() > 1:
        counts[int(np.argmax(counts))] -= 1
    for i in np.argsort(-(raw - np.floor(raw)))[: max(n_examples - int(counts.sum()), 0)]:
        counts[i] += 1
    return counts.tolist()


def _provenance(request: SynthesisRequest, cluster: FailureCluster, generator: str, kind: str, **extra: Any) -> str:
    return json.dumps({"round": request.round, "cluster": cluster.name, "generator": generator, "kind": kind, **extra},
                      sort_keys=True, ensure_ascii=False)


def with_provenance(table: pa.Table, provenance: Sequence[str] | str) -> pa.Table:
    values = [provenance] * table.num_rows if isinstance(provenance, str) else list(provenance)
    return table.select(QUESTION_SCHEMA.names).cast(QUESTION_SCHEMA).append_column(
        pa.field("provenance", pa.string(), nullable=False), pa.array(values, pa.string()))


class BuiltinTargetedGenerator:
    """The built-in benchmark's targeted mode: new users, aimed at each cluster's family and variant."""

    name = "builtin_targeted"

    def __init__(self, benchmark_config: Any) -> None:
        self.config = benchmark_config

    def synthesize(self, request: SynthesisRequest, train: pa.Table) -> pa.Table:
        from envloop_pipelines.core.benchmark import FAMILIES, VARIANTS, generate_targeted

        parts = []
        for i, (cluster, n) in enumerate(zip(request.clusters, allocate(request.clusters, request.n_examples))):
            if n == 0:
                continue
            family = cluster.key.get("family") if cluster.key.get("family") in FAMILIES else None
            variant = cluster.key.get("variant") if cluster.key.get("variant") in VARIANTS else None
            objects = generate_targeted(self.config, n_records=n, family=family, variant=variant,
                                        seed=request.seed * 1000 + i, id_prefix=f"{request.round}c{i}")
            records = records_from_objects([(o, k) for k, o in enumerate(objects, 1)], file=f"<synthesis {cluster.name}>",
                                           token_budget=None)
            parts.append(with_provenance(questions_table(records),
                                         _provenance(request, cluster, self.name, "targeted_new_users",
                                                     family=family, variant=variant)))
        return pa.concat_tables(parts) if parts else SNAPSHOT_SCHEMA.empty_table()


_PARAPHRASES: tuple[str, ...] = (
    "{q}",
    "Question: {q}",
    "Decide the following. {q}",
    "Based only on the information given: {q}",
)


class VariantGenerator:
    """Label-preserving variants of training questions in the clusters' families (imported data)."""

    name = "label_preserving_variants"

    def synthesize(self, request: SynthesisRequest, train: pa.Table) -> pa.Table:
        rng = np.random.default_rng(request.seed)
        rows = [r for r in train.to_pylist() if r.get("label") is not None]
        out: list[dict[str, Any]] = []
        provenance: list[str] = []
        for cluster, n in zip(request.clusters, allocate(request.clusters, request.n_examples)):
            pool = [r for r in rows if r["family"] == cluster.key.get("family", r["family"])
                    and (cluster.key.get("variant") in (None, "unknown") or r.get("variant") == cluster.key.get("variant"))]
            pool = pool or [r for r in rows if r["family"] == cluster.key.get("family")]
            if not pool:
                continue
            for _ in range(n):
                row = dict(pool[int(rng.integers(len(pool)))])
                kind = self._vary(row, rng, rid_suffix=f"~{request.round}-{len(out)}")
                out.append(row)
                provenance.append(_provenance(request, cluster, self.name, kind, source_record=row["record_id"].split("~")[0]))
        if not out:
            return SNAPSHOT_SCHEMA.empty_table()
        return with_provenance(pa.Table.from_pylist(out, schema=QUESTION_SCHEMA), provenance)

    @staticmethod
    def _vary(row: dict[str, Any], rng: np.random.Generator, rid_suffix: str) -> str:
        """Apply one label-preserving transformation in place; return its kind."""
        row["record_id"] = row["record_id"] + rid_suffix
        choices = ["paraphrase", "reweight"]
        if row["type"] == "choice" and len(row["option_keys"]) > 2:
            choices.append("option_permutation")
        if row["type"] == "noul" and row.get("soft_label") is None:
            choices.append("negation")
        kind = choices[int(rng.integers(len(choices)))]
        if kind == "option_permutation":
            order = rng.permutation(len(row["option_keys"])).tolist()
            label_key = row["option_keys"][row["label"]]
            row["option_keys"] = [row["option_keys"][i] for i in order]
            row["option_texts"] = [row["option_texts"][i] for i in order]
            row["label"] = row["option_keys"].index(label_key)
            if row.get("soft_label") is not None:
                row["soft_label"] = [row["soft_label"][i] for i in order]
        elif kind == "negation":
            # Same options, the question asked the other way round: the label flips.
            row["instructions_text"] = f"Is the following false? {row['instructions_text']}"
            row["option_texts"] = [row["option_texts"][1], row["option_texts"][0]]
            row["label"] = 1 - row["label"]
        elif kind == "paraphrase":
            template = _PARAPHRASES[1 + int(rng.integers(len(_PARAPHRASES) - 1))]
            row["instructions_text"] = template.format(q=row["instructions_text"])
        return kind


BUILTIN_GENERATORS: dict[str, Any] = {"builtin_targeted": BuiltinTargetedGenerator,
                                      "label_preserving_variants": VariantGenerator}
#: Limits of a user generator's sandboxed run: generous (a generator may load a model), but bounded.
GENERATOR_LIMITS = dict(cpu_s=1800.0, wall_s=1800.0, mem_mb=16384, fsize_mb=1024, nofile=1024, nproc=256,
                        channel_bytes=512 * 1024 * 1024)


def load_generator(spec: str, *, home: str | Path | None = None, sandbox: Any = None,
                   **kwargs: Any) -> EnvironmentGenerator:
    """A generator by name: one of ours in this process, a user's (``module:attribute`` or an entry point) in the sandbox.

    The generators that ship (:data:`BUILTIN_GENERATORS`) are this package's code and run in the loop's
    process. Any other is user code: it runs as a :class:`SandboxedGenerator`, in the sandbox
    (the deployment's, ``sandbox``; the local one by default: a fresh uid, the label folder of ``home`` hidden,
    no network), never in the loop's process, whose user owns the label files. It is loaded there once here,
    so a spec that does not import or has no ``synthesize`` fails now.

    Args:
        spec: ``builtin_targeted``, ``label_preserving_variants``, ``module:attribute`` (a class, a factory or
            an object) or the name of an entry point in ``envloop.environment_generators``.
        home: the EnvLoop home whose ``verifier`` folder the sandbox hides (default ``$ENVLOOP_HOME``).
        sandbox: the sandbox a user generator runs in, or the deployment's
            :class:`~envloop_pipelines.core.sandbox.SandboxSettings` to build it from (under
            :data:`GENERATOR_LIMITS`); default: the local backend.
        kwargs: the generator's constructor arguments (JSON values for a user generator).

    Raises:
        ValueError: an unknown name, or a user generator that does not load in the sandbox.
        TypeError: a generator with no ``synthesize(request, train)`` method.
        SandboxRefusedError: the sandbox cannot hide the labels from a user generator on this host.
    """
    if spec in BUILTIN_GENERATORS:
        return resolve_generator(spec, **kwargs)
    if ":" not in spec and not any(ep.name == spec for ep in entry_points(group=ENTRY_POINT_GROUP)):
        raise ValueError(f"unknown environment generator {spec!r}: use {', '.join(BUILTIN_GENERATORS)}, an entry point in "
                         f"{ENTRY_POINT_GROUP!r}, or 'module:attribute'")
    return SandboxedGenerator(spec, home=home, sandbox=sandbox, kwargs=kwargs)


def resolve_generator(spec: str, **kwargs: Any) -> EnvironmentGenerator:
    """Import and build the generator ``spec`` names in this process (the sandbox worker calls it for user code)."""
    if spec in BUILTIN_GENERATORS:
        factory: Any = BUILTIN_GENERATORS[spec]
    elif ":" in spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not found:
            raise ValueError(f"unknown environment generator {spec!r}: use {', '.join(BUILTIN_GENERATORS)}, an entry point in "
                             f"{ENTRY_POINT_GROUP!r}, or 'module:attribute'")
        factory = found[0].load()
    generator = factory(**kwargs) if isinstance(factory, type) or callable(factory) else factory
    if not hasattr(generator, "synthesize"):
        raise TypeError(f"environment generator {spec!r} has no synthesize(request, train) method")
    return generator


class SandboxRefusedError(RuntimeError):
    """The sandbox on this host cannot keep a user generator from the label files."""


class SandboxedGenerator:
    """A user's generator, run in the sandbox: clusters and train rows in as JSON, rows back as JSON.

    Each call is a fresh sandboxed process (:mod:`envloop_pipelines.core.decision_loop.generator_worker`) under
    :data:`GENERATOR_LIMITS`: another uid than the loop's, the home's ``verifier`` folder hidden, no network, a
    scrubbed environment (no ``ENVLOOP_HOME``). The rows it returns are typed against ``SNAPSHOT_SCHEMA`` here
    and, like every row, contamination-checked in the training snapshot.
    """

    def __init__(self, spec: str, *, home: str | Path | None = None, sandbox: Any = None,
                 kwargs: Mapping[str, Any] | None = None) -> None:
        from envloop_pipelines.core.storage import envloop_home

        self.spec = spec
        self.kwargs = dict(kwargs or {})
        self.home = envloop_home(home)
        self._sandbox = sandbox
        self.last_run: dict[str, Any] | None = None
        self.name = str(self._call({"describe": True})["name"])

    def _sandbox_for_run(self) -> Any:
        from envloop_pipelines.core.sandbox import SandboxLimits, SandboxSettings, make_sandbox

        sandbox = self._sandbox
        if sandbox is None or isinstance(sandbox, SandboxSettings):
            sandbox = make_sandbox(sandbox or SandboxSettings(), limits=SandboxLimits(**GENERATOR_LIMITS))
        caps = sandbox.capabilities()
        if not caps.get("hidden_paths_masked") or (caps.get("backend") == "local" and not caps.get("uid_switch")):
            raise SandboxRefusedError(
                f"environment generator {self.spec!r} is user code and runs only in a sandbox that hides the label "
                f"files from it (another uid, the label folder masked); this host's {caps.get('backend')} sandbox "
                f"cannot ({ {k: caps.get(k) for k in ('uid_switch', 'hidden_paths_masked', 'detail')} }): run the "
                f"loop as root, configure the deployment's sandbox as docker, or use a built-in generator")
        return sandbox

    def _call(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        from envloop_pipelines.core.sandbox import SandboxCall, SandboxLimits

        sandbox = self._sandbox_for_run()
        body = json.dumps({"spec": self.spec, "kwargs": self.kwargs, **payload}, ensure_ascii=False).encode("utf-8")
        # The generator's module is imported from where the loop would import it (the environment is scrubbed).
        path = os.pathsep.join(dict.fromkeys(os.path.abspath(p or os.curdir) for p in sys.path
                                             if os.path.isdir(p or os.curdir)))
        worker = [sys.executable, "-m", "envloop_pipelines.core.decision_loop.generator_worker"]
        result = sandbox.run(worker, SandboxCall(
            stdin=body, result_channel=True, limits=SandboxLimits(**GENERATOR_LIMITS),
            hidden_paths=[self.home / "verifier"], env={"PYTHONPATH": path}))
        self.last_run = result.to_dict(include_channel=False)
        try:
            answer = json.loads(result.channel) if result.channel else None
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "error" in answer:
            err = answer["error"]
            kind = TypeError if err.get("type") == "TypeError" else ValueError
            raise kind(f"environment generator {self.spec!r} failed in the sandbox: {err.get('type')}: "
                       f"{err.get('message')}")
        if not result.ok or not isinstance(answer, dict):
            raise ValueError(f"environment generator {self.spec!r} failed in the sandbox ({result.status}: "
                             f"{result.detail}): {result.stderr_tail[-2000:]}")
        return answer

    def synthesize(self, request: SynthesisRequest, train: pa.Table) -> pa.Table:
        payload = {"request": {"round": request.round, "n_examples": request.n_examples, "seed": request.seed,
                               "clusters": [dataclasses.asdict(c) for c in request.clusters]},
                   "train": train.select(QUESTION_SCHEMA.names).cast(QUESTION_SCHEMA).to_pylist()}
        answer = self._call(payload)
        self.name = str(answer.get("name", self.name))
        try:
            return pa.Table.from_pylist(list(answer.get("rows") or []), schema=SNAPSHOT_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, KeyError) as exc:
            raise ValueError(f"environment generator {self.spec!r}: its rows do not fit SNAPSHOT_SCHEMA: {exc}") from exc
