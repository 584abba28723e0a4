"""The asset ``environment_synthesis``: new training rows aimed at the top failure clusters.

The generators themselves (the built-in targeted one, the label-preserving variants, a user's generator run in
the sandbox) are in ``core/decision_loop/synthesis.py``; this step picks the clusters, runs the loop's generator,
writes the rows to the round's folder and stores them as the environment dataset ``<task>-<round>``.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from envloop_pipelines.core.data.snapshots import TaskSnapshot
from envloop_pipelines.core.decision_loop.failure_mining import top_clusters
from envloop_pipelines.core.decision_loop.step_records import EnvironmentSynthesis, FailureMining
from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA, SynthesisRequest, load_generator
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import LoopConfig, round_number
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.storage import atomic_write_parquet, sha256_file


def synthesize_environments(config: LoopConfig, task: TaskSnapshot, mined: FailureMining, *,
                            sandbox: SandboxSettings | None = None) -> EnvironmentSynthesis:
    """New training rows aimed at the top clusters, each with provenance to its cluster.

    ``sandbox``: the deployment's sandbox, where a user generator runs (default: the local backend).
    """
    key = mined.round
    clusters = top_clusters(mined, config.top_clusters)
    kwargs: dict[str, Any] = {}
    if config.generator == "builtin_targeted":
        from envloop_pipelines.core.benchmark import BenchmarkConfig

        kwargs["benchmark_config"] = BenchmarkConfig(seed=int(task.manifest.extra.get("generator", {}).get("seed", 0)))
    generator = load_generator(config.generator, home=config.home, sandbox=sandbox, **kwargs)  # a user's: in the sandbox
    request = SynthesisRequest(round=key, clusters=clusters, n_examples=config.n_synthesized, seed=round_number(key))
    table = generator.synthesize(request, task.table("train")) if clusters else SNAPSHOT_SCHEMA.empty_table()
    path = atomic_write_parquet(RoundStore(config.task, config.home).round_dir(key) / "synthesized.parquet", table,
                                overwrite=True)
    per_cluster: dict[str, int] = {}
    for p in table.column("provenance").to_pylist():
        name = json.loads(p)["cluster"]
        per_cluster[name] = per_cluster.get(name, 0) + 1
    generator_name = getattr(generator, "name", config.generator)
    digest = sha256_file(path)
    return EnvironmentSynthesis(round=key, generator=generator_name, n_rows=table.num_rows,
                                per_cluster=per_cluster, clusters=tuple(c.name for c in clusters), path=str(path),
                                sha256=digest, environment_dataset=_store_synthesized(config, key, table, generator_name,
                                                                                      digest))

def _store_synthesized(config: LoopConfig, key: str, table: pa.Table, generator: str, digest: str) -> str | None:
    """The synthesized rows as a decision-environment dataset ``<task>-<round>``; its ``name@version`` (None if empty).

    The training rows stay the Parquet file above (the training snapshot reads that, so its hash does not move);
    the dataset is the same questions as environments with ``rule`` verifiers, for agents and RL rounds.
    """
    from envloop_pipelines.core.environments.dataset import store_dataset
    from envloop_pipelines.core.environments.generators import synthesis_dataset_name, synthesis_environments

    specs = synthesis_environments(table, task=config.task, round_key=key)
    if not specs:
        return None
    stored = store_dataset(synthesis_dataset_name(config.task, key), specs, home=config.home,
                           source={"generator": "environment_synthesis", "task": config.task, "round": key,
                                   "synthesis_generator": generator, "synthesis_sha256": digest})
    return stored.ref


__all__ = ["synthesize_environments"]
