"""Agent evaluations are partitioned two ways: the dataset version and the agent, both dynamic.

A ``dataset_version`` key is ``<dataset>@<version>``; an ``agent`` key is ``<model>@<base_url>``
(:attr:`~envloop_pipelines.core.agents.client.AgentSpec.label`). The UI then shows agents side by
side on each dataset version.
"""

import dagster as dg

env_dataset_versions = dg.DynamicPartitionsDefinition(name="env_dataset_versions")
agents = dg.DynamicPartitionsDefinition(name="agents")
agent_evaluation_partitions = dg.MultiPartitionsDefinition({"dataset_version": env_dataset_versions, "agent": agents})


def add_agent_evaluation_partition(instance: dg.DagsterInstance, dataset_key: str, agent_key: str) -> dg.MultiPartitionKey:
    """Register both keys (idempotent) and return the partition to materialize."""
    for definition, key in ((env_dataset_versions, dataset_key), (agents, agent_key)):
        if not instance.has_dynamic_partition(definition.name, key):
            instance.add_dynamic_partitions(definition.name, [key])
    return dg.MultiPartitionKey({"dataset_version": dataset_key, "agent": agent_key})
