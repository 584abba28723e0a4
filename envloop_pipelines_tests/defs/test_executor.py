"""ENVLOOP_EXECUTOR picks the executor when the code location loads: k8s_job_executor on a cluster, Dagster's
default (multiprocess) otherwise. Each case loads the definitions in a fresh interpreter, as Dagster does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from envloop_pipelines.defs.executor import EXECUTOR_ENV, select_executor

PROBE = """
import json, sys
import dagster as dg
from envloop_pipelines.definitions import defs as load_code_location
defs = load_code_location()
repo = defs.get_repository_def()
op_tags = repo.assets_defs_by_key[dg.AssetKey("lora_checkpoint")].op.tags
print(json.dumps({
    "round_job": defs.resolve_job_def("round_job").executor_def.name,
    "setup_job": defs.resolve_job_def("setup_job").executor_def.name,
    "dagster_k8s_imported": "dagster_k8s" in sys.modules,
    "training_pod": json.loads(op_tags["dagster-k8s/config"]),
}))
"""


def _load(executor: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != EXECUTOR_ENV}
    if executor is not None:
        env[EXECUTOR_ENV] = executor
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_k8s_executor_runs_each_step_as_a_job_and_training_asks_for_a_gpu() -> None:
    loaded = _load("k8s")
    assert loaded["round_job"] == loaded["setup_job"] == "k8s"
    container = loaded["training_pod"]["container_config"]["resources"]
    assert container["limits"]["nvidia.com/gpu"] == "1" and container["limits"]["memory"] == "32Gi"
    assert container["requests"] == {"cpu": "4", "memory": "16Gi"}


@pytest.mark.parametrize("executor", [None, "multiprocess"])
def test_default_is_dagsters_multiprocess_executor_without_dagster_k8s(executor: str | None) -> None:
    loaded = _load(executor)
    assert loaded["round_job"] == loaded["setup_job"] == "multi_or_in_process_executor"
    assert loaded["dagster_k8s_imported"] is False
    assert "nvidia.com/gpu" in loaded["training_pod"]["container_config"]["resources"]["limits"]  # tags stay; ignored locally


def test_default_executor_runs_steps_in_processes() -> None:
    import dagster as dg

    assert select_executor(None) is None and select_executor("") is None
    assert dg.multi_or_in_process_executor.config_schema.as_field().default_value == {"multiprocess": {}}


def test_unknown_executor_is_an_error_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="allowed: multiprocess, k8s"):
        select_executor("gpu")
    assert select_executor(" K8S ").name == "k8s"


def test_in_process_executor_runs_every_step_in_the_run_process() -> None:
    loaded = _load("in_process")
    assert loaded["round_job"] == loaded["setup_job"] == "in_process"
    assert loaded["dagster_k8s_imported"] is False
