"""Dagster's names in this project: the jobs, partitions, assets and run tags, spelled once.

``defs/`` defines the jobs and partitions under these names; the CLI, the SDK and the sensors read
and write runs by them. This module imports nothing of ours, so every layer may import it (core does
not need it: core never speaks Dagster).
"""

from __future__ import annotations

#: The decision round's job (one run per ``rounds`` partition) and the setup job (benchmark + noise floor).
ROUND_JOB = "round_job"
SETUP_JOB = "setup_job"
#: The dynamic partitions of the decision rounds (``r0001``, ``r0002`` ...).
ROUNDS_PARTITIONS = "rounds"

#: Assets a client reads or configures.
PROMOTION_DECISION = "promotion_decision"
NOISE_FLOOR = "noise_floor"
HYPOTHESIS_ASSET = "registered_hypothesis"

#: Dagster's own run tags.
PARTITION_TAG = "dagster/partition"
PARENT_RUN_TAG = "dagster/parent_run_id"
ROOT_RUN_TAG = "dagster/root_run_id"
#: The sensor or schedule that requested a run (the door a round came through, ``defs/rounds/assets.py``).
SENSOR_NAME_TAG = "dagster/sensor_name"
SCHEDULE_NAME_TAG = "dagster/schedule_name"
#: Set to ``false`` on a run Dagster must not retry (a refused hypothesis).
NO_RETRY_TAG = "dagster/retry_on_asset_or_op_failure"

#: Our run tags. ``LOOP_TAG``: the loop (and run key) a round's run belongs to.
LOOP_TAG = "envloop/loop"
#: Who launched a run (``sdk``).
CLIENT_TAG = "envloop/client"
#: A run its first step refused (``hypothesis``: a bad hypothesis; ``busy``: another run of the task's loop, its setup
#: or a round, held the loop's claim): never retried, nothing written to the ledger.
REFUSED_TAG = "envloop/refused"
#: ``REFUSED_TAG``'s value on a run refused because another run of the task's loop held the claim.
REFUSED_BUSY = "busy"
#: The run that held the loop's claim when a run was refused as busy (``defs/rounds/assets.py``).
BUSY_WITH_TAG = "envloop/busy_with"
#: The worker that executes a run in-process (``defs/rounds/recovery.py`` reaps runs whose worker is gone).
HOST_TAG = "envloop/host"
PID_TAG = "envloop/pid"
#: The loop settings a CLI run was started with (read back by ``round retry``), and the run it retries.
SETTINGS_TAG = "envloop/loop_settings"
RETRY_OF_TAG = "envloop/retry_of"
#: The GPU pool a round's run takes (the run queue's tag concurrency limit, ``k8s/dagster/values.yaml``).
GPU_POOL_TAG = "envloop/gpu-pool"
