"""The Dockerfile and .dockerignore, checked without a Docker engine: parsed with Docker's own parser
(the ``dockerfile`` package wraps BuildKit's), the build context computed with docker-py's .dockerignore rules."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import dockerfile
import pytest
import yaml
from docker.utils.build import exclude_paths

REPO = Path(__file__).resolve().parents[2]
TORCH_INDEX = "https://download.pytorch.org/whl/${TORCH_VARIANT}"


def _instructions(text: str | None = None) -> list[dockerfile.Command]:
    return list(dockerfile.parse_string(text) if text is not None else dockerfile.parse_file(str(REPO / "Dockerfile")))


def _final_stage(commands: list[dockerfile.Command]) -> list[dockerfile.Command]:
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    return commands[last_from:]


def _env(commands: list[dockerfile.Command]) -> dict[str, str]:
    env: dict[str, str] = {}
    for c in commands:
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2]))
    return env


def test_both_stages_build_on_python_311_slim() -> None:
    assert [c.value[0] for c in _instructions() if c.cmd == "FROM"] == ["python:3.11-slim", "python:3.11-slim"]


def test_install_uses_the_constraints_and_the_torch_index_of_the_variant() -> None:
    commands = _instructions()
    (variant,) = {c.value[0] for c in commands if c.cmd == "ARG" and c.value[0].startswith("TORCH_VARIANT")}
    assert variant == "TORCH_VARIANT=cpu"
    (install,) = [c.value[0] for c in commands if c.cmd == "RUN" and "pip install" in c.value[0]]
    assert re.search(r"pip install -c constraints\.txt --extra-index-url \"" + re.escape(TORCH_INDEX) + r"\" \.", install)
    # The torch pins agree: pyproject's torch==2.13.0, constraints' +cpu build, and the line the build swaps.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in project
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    assert constraints.count("torch==2.13.0+cpu") == 1
    sed = re.search(r'sed -i "s/(.+?)/(.+?)/" constraints\.txt', install)
    assert sed is not None
    pattern = sed.group(1).replace("\\.", ".")  # sed's basic regex: "+" is literal, "\." a dot
    assert pattern == "^torch==2.13.0+cpu$" and sed.group(2) == "torch==2.13.0+${TORCH_VARIANT}"
    install_at = next(i for i, c in enumerate(commands) if c.cmd == "RUN" and "pip install" in c.value[0])
    assert _env(commands[:install_at])["DS_BUILD_OPS"] == "0"


def test_final_stage_runs_as_the_manifests_non_root_user_offline() -> None:
    final = _final_stage(_instructions())
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] == "10001"
    user_at = max(i for i, c in enumerate(final) if c.cmd == "USER")
    assert not any(c.cmd == "RUN" for c in final[user_at:]), "nothing runs as root after USER"
    env = _env(final)
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1" and env["ENVLOOP_HOME"] == "/envloop-home"
    values = yaml.safe_load((REPO / "k8s" / "dagster" / "values.yaml").read_text())
    (dep,) = values["dagster-user-deployments"]["deployments"]
    assert dep["podSecurityContext"]["runAsUser"] == 10001 and dep["env"]["ENVLOOP_HOME"] == env["ENVLOOP_HOME"]


def test_no_entrypoint_and_the_code_server_by_default() -> None:
    final = _final_stage(_instructions())
    assert not [c for c in _instructions() if c.cmd == "ENTRYPOINT"], "the chart passes whole commands as args"
    (cmd,) = [c for c in final if c.cmd == "CMD"]
    assert cmd.json and list(cmd.value) == ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", "3030", "-m",
                                            "envloop_pipelines.definitions"]


def test_parser_reads_what_the_checks_rely_on() -> None:
    """The checks above fail on a Dockerfile that installs unpinned or runs as root."""
    bad = _instructions("FROM python:3.11-slim\nRUN pip install .\nUSER root\nCMD envloop serve\n")
    assert not any("-c constraints.txt" in c.value[0] for c in bad if c.cmd == "RUN")
    assert [c.value[0] for c in bad if c.cmd == "USER"] == ["root"]
    assert [c.json for c in bad if c.cmd == "CMD"] == [False]
    with pytest.raises(dockerfile.GoParseError):
        _instructions("FROM python:3.11-slim\nENV HF_HUB_OFFLINE\n")  # BuildKit: "ENV must have two arguments"


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    # docker-py's exclude_paths yields what the patterns let into the context (files and folders).
    context = {p for p in exclude_paths(str(REPO), patterns) if (REPO / p).is_file()}
    for needed in ("pyproject.toml", "constraints.txt", "README.md", "dagster.yaml", "envloop_pipelines/definitions.py",
                   "envloop_pipelines/recipes/label_token_qwen_gpu.yaml", "envloop_pipelines/recipes/deepspeed_zero2.json"):
        assert needed in context, needed
    tops = {p.split("/")[0] for p in context}
    # Docker always sends the Dockerfile and .dockerignore themselves.
    assert tops <= {"pyproject.toml", "constraints.txt", "README.md", "dagster.yaml", "envloop_pipelines", "Dockerfile",
                    ".dockerignore"}, tops
    assert not [p for p in context if "__pycache__" in p or p.endswith(".pyc")]
    # Every COPY source of the build stage is in the context.
    for c in _instructions():
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags):
            for source in c.value[:-1]:
                assert any(p == source or p.startswith(source.rstrip("/") + "/") for p in context), source
