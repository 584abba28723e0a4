"""Rounds are dynamic partitions: r0001, r0002, ..."""

import dagster as dg

from envloop_pipelines.names import ROUNDS_PARTITIONS

rounds = dg.DynamicPartitionsDefinition(name=ROUNDS_PARTITIONS)
