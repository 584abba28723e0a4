"""Rounds are dynamic partitions: r0001, r0002, ..."""

import dagster as dg

rounds = dg.DynamicPartitionsDefinition(name="rounds")
