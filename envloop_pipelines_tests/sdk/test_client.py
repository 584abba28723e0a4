"""The SDK without a deployment: its GraphQL documents against the webserver's schema, and bad input.

The SDK against a real deployment is ``integration/test_remote.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import ClientError
from envloop_pipelines.sdk.records import RunInfo
from envloop_pipelines.sdk import queries
from envloop_pipelines.sdk.client import _hypothesis_json
from envloop_pipelines.sdk.webserver import _split_url

GOOD = {"change": {"kind": "recipe", "recipe_diff": {"max_steps": 80}}, "predicted_delta": 0.02,
        "gate": {"primary_metric": "family_macro_accuracy", "min_delta": 0.01}, "rationale": "under-trained"}


@pytest.mark.parametrize("name", sorted(queries.ALL))
def test_every_document_is_valid_for_the_webservers_schema(name: str) -> None:
    from dagster_graphql.schema import create_schema
    from graphql import parse, validate

    errors = validate(create_schema().graphql_schema, parse(queries.ALL[name]))
    assert errors == [], [e.message for e in errors]


def test_urls() -> None:
    assert _split_url("http://127.0.0.1:3000") == {"hostname": "127.0.0.1", "port_number": 3000, "use_https": False,
                                                   "path_prefix": ""}
    assert _split_url("https://dagster.example.com/dagster/graphql") == {
        "hostname": "dagster.example.com", "port_number": None, "use_https": True, "path_prefix": "/dagster"}
    assert _split_url("localhost:3000")["port_number"] == 3000
    for bad in ("ftp://host", "http://", "://"):
        with pytest.raises(ClientError, match="dagster_url: .* is not an http\\(s\\) URL"):
            Client(bad)


def test_a_hypothesis_is_checked_before_anything_is_launched(tmp_path: Path) -> None:
    assert json.loads(_hypothesis_json(GOOD)) == GOOD
    assert json.loads(_hypothesis_json(json.dumps(GOOD))) == GOOD
    (tmp_path / "hyp.json").write_text(json.dumps(GOOD))
    assert json.loads(_hypothesis_json(tmp_path / "hyp.json")) == GOOD
    assert json.loads(_hypothesis_json(str(tmp_path / "hyp.json"))) == GOOD
    assert _hypothesis_json(None) is None
    with pytest.raises(ClientError, match="gate"):
        _hypothesis_json({**GOOD, "gate": {"floor_multiplier": 0.5}})
    with pytest.raises(ClientError, match="recipe_overrides"):
        _hypothesis_json({**GOOD, "change": {"kind": "recipe", "recipe_overrides": {"max_steps": 80}}})
    with pytest.raises(ClientError, match=r"hypothesis: line 1: Expecting"):
        _hypothesis_json('{"change": ')
    with pytest.raises(ClientError, match="must be a JSON object"):
        _hypothesis_json("[1, 2]")
    with pytest.raises(ClientError, match="'nope.json' is neither JSON text nor a file"):
        _hypothesis_json("nope.json")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ClientError, match=r"bad.json: line 1:"):
        _hypothesis_json(tmp_path / "bad.json")


def test_a_run_as_the_webserver_reports_it() -> None:
    run = RunInfo.from_graphql({
        "runId": "r-1", "jobName": "round_job", "status": "STARTED", "startTime": 100.0, "endTime": None,
        "creationTime": 99.0, "tags": [{"key": "dagster/partition", "value": "r0003"}],
        "stepStats": [{"stepKey": "baseline_eval", "status": "SUCCESS", "startTime": 101.5, "endTime": 104.0},
                      {"stepKey": "failure_mining", "status": "IN_PROGRESS", "startTime": 104.5, "endTime": None}]})
    assert (run.partition, run.finished, run.success, run.first_step_start) == ("r0003", False, False, 101.5)
    assert [s.key for s in run.steps] == ["baseline_eval", "failure_mining"]


def test_a_client_without_mlflow_says_which_setting_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    client = Client("http://127.0.0.1:9")
    with pytest.raises(ClientError, match="mlflow_uri: not set"):
        client.mlflow  # noqa: B018
    with pytest.raises(ClientError, match="the Dagster webserver at http://127.0.0.1:9 did not answer"):
        client.round_keys()


def test_evaluate_needs_exactly_one_source(tmp_path: Path) -> None:
    with pytest.raises(ClientError, match="records/task: give exactly one"):
        Client.evaluate(tmp_path)
    with pytest.raises(ClientError, match="records/task: give exactly one"):
        Client.evaluate(tmp_path, records=tmp_path / "x.jsonl", task="t")
    with pytest.raises(ClientError, match="split: 'test' is not an open split"):
        Client.evaluate(tmp_path, task="t", split="test")


def test_a_start_while_a_round_runs_on_the_deployment_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: the remote Client accepted a second start_round while one ran. It now asks the deployment for a
    round run that has not ended before adding a partition (the round's first step claims the round on the
    deployment for starts that pass this check together: ``sdk/test_local_client_rounds.py``)."""
    from envloop_pipelines.sdk.errors import RefusedError

    client = Client("http://127.0.0.1:9")
    client._settings = {"task": "personal_agent"}
    monkeypatch.setattr(client, "probe", lambda: None, raising=False)  # no servers here
    monkeypatch.setattr(client, "is_set_up", lambda: True)
    asked: dict = {}

    def runs(job: str, *, partition: str | None = None, limit: int = 50, statuses: object = None) -> list[RunInfo]:
        asked.setdefault("jobs", []).append(job)
        asked.update(statuses=statuses)
        return [RunInfo(run_id="abc", job=job, status="STARTED", partition="r0003", start_time=None, end_time=None,
                        created=None, tags={}, steps=())] if job == "round_job" else []

    monkeypatch.setattr(client, "runs", runs)
    monkeypatch.setattr(client, "add_round", lambda key=None: pytest.fail("a partition was added"))
    with pytest.raises(RefusedError, match=r"^round r0003 of task 'personal_agent' is running \(run abc, STARTED\)"):
        client.start_round()
    assert asked["jobs"] == ["setup_job", "round_job"] and set(asked["statuses"]) >= {"QUEUED", "STARTING", "STARTED"}


def test_a_setup_beside_a_run_of_the_deployments_loop_is_refused_as_busy_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47: a second setup on a deployment ran beside the first. ``Client.setup`` asks the deployment for a setup
    or round run that has not ended before launching; a setup that passed that check together with another is refused
    by its first step (the deployment's claim: ``sdk/test_loop_claim.py``), and ``setup`` raises ``BusyError`` with
    that step's one line, telling a person here how to follow or cancel the holder with ``--remote``."""
    from envloop_pipelines.names import BUSY_WITH_TAG, REFUSED_TAG
    from envloop_pipelines.sdk.errors import BusyError, RefusedError
    from envloop_pipelines.sdk.records import RunError

    url = "http://127.0.0.1:9"
    client = Client(url)
    client._settings = {"task": "personal_agent"}
    monkeypatch.setattr(client, "probe", lambda: None, raising=False)  # no servers here
    running: dict[str, list[RunInfo]] = {"setup_job": [], "round_job": []}
    monkeypatch.setattr(client, "runs", lambda job, **kw: running[job])
    launched: list[str] = []
    monkeypatch.setattr(client, "_launch", lambda job, **kw: launched.append(job) or "mine")

    def run(run_id: str, job: str, status: str, tags: dict[str, str], partition: str | None = None) -> RunInfo:
        return RunInfo(run_id=run_id, job=job, status=status, partition=partition, start_time=None, end_time=None,
                       created=None, tags=tags, steps=())

    for job, partition, what in (("setup_job", None, "the setup"), ("round_job", "r0002", "round r0002")):
        running.update({"setup_job": [], "round_job": []}, **{job: [run("theirs", job, "STARTED", {}, partition)]})
        with pytest.raises(BusyError) as busy:
            client.setup(progress=False)
        assert str(busy.value) == (f"{what} of task 'personal_agent' is running (run theirs, STARTED): wait for it "
                                   f"(follow it in {url}) or cancel it (`envloop round cancel theirs --remote {url}`)")
        assert isinstance(busy.value, RefusedError) and busy.value.run_id == "theirs" and launched == []

    running.update({"setup_job": [], "round_job": []})  # both passed the check: the step's claim tells them apart
    step = ("setup: refused: the setup of task 'personal_agent' is running (run theirs, started by a launch of "
            "setup_job on h): wait for it (follow it in `envloop ui`) or cancel it (`envloop round cancel theirs`)")
    monkeypatch.setattr(client, "wait", lambda run_id, **kw: run(run_id, "setup_job", "FAILURE", {
        REFUSED_TAG: "busy", BUSY_WITH_TAG: "theirs"}))
    monkeypatch.setattr(client, "run_error", lambda run_id: RunError(step="task_benchmark", message=step))
    with pytest.raises(BusyError) as busy:
        client.setup(progress=False)
    assert launched == ["setup_job"] and busy.value.run_id == "theirs"
    assert str(busy.value) == step.replace("(follow it in `envloop ui`) or cancel it (`envloop round cancel theirs`)",
                                           f"(follow it in {url}) or cancel it (`envloop round cancel theirs "
                                           f"--remote {url}`)")


def test_a_release_answers_as_the_same_model_id_locally_and_remotely(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: one release, two model ids (``envloop-personal_agent-r0001`` from the home's chain,
    ``envloop-<sha256>-<sha12>`` from MLflow); docs/serving.md says the first."""
    ckpt = tmp_path / ("ab" * 32)
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"model.safetensors": "cd" * 32}}), encoding="utf-8")
    client = Client("http://127.0.0.1:9")
    client._settings = {"task": "personal_agent"}
    monkeypatch.setattr(client, "_release_number", lambda release: 1)
    monkeypatch.setattr(client, "fetch_checkpoint", lambda release, dest: ckpt)
    source = client._release_source("champion", tmp_path)
    assert (source.model_id, source.release, source.task) == ("envloop-personal_agent-r0001", 1, "personal_agent")


# --------------------------------------------------------------------------- the error answers (queries.ERRORS)

#: Each GraphQL error type the documents ask for and the SDK error it raised before the table (issue 46): the
#: ``...NotFoundError`` types, the five refusals of bad input, and the rest a ClientError.
ERROR_CLASSES = {
    "PythonError": "ClientError", "UnauthorizedError": "ClientError", "InvalidSubsetError": "ClientError",
    "ConflictingExecutionParamsError": "ClientError", "NoModeProvidedError": "ClientError",
    "InvalidPipelineRunsFilterError": "ClientError", "TerminateRunFailure": "ClientError",
    "RunConfigValidationInvalid": "RefusedError", "RunConflict": "RefusedError", "InvalidStepError": "RefusedError",
    "InvalidOutputError": "RefusedError", "DuplicateDynamicPartitionError": "RefusedError",
    "PipelineNotFoundError": "NotFoundError", "PresetNotFoundError": "NotFoundError",
    "RunNotFoundError": "NotFoundError", "RepositoryNotFoundError": "NotFoundError",
    "AssetNotFoundError": "NotFoundError",
}


def _branches(document: str) -> set[str]:
    """The type conditions of the inline fragments directly under the document's one field."""
    from graphql import parse

    (operation,) = parse(document).definitions
    (field,) = operation.selection_set.selections
    return {s.type_condition.name.value for s in field.selection_set.selections if hasattr(s, "type_condition")}


def test_every_error_type_a_document_asks_for_is_spelled_once_in_the_table() -> None:
    asked = set().union(*(_branches(d) for d in queries.ALL.values()))
    success = {"RepositoryConnection", "Repository", "Pipeline", "AssetNode", "AddDynamicPartitionSuccess",
               "LaunchRunSuccess", "Run", "Runs", "EventConnection", "TerminateRunSuccess", "Asset"}
    assert asked - success == set(queries.ERRORS) == set(ERROR_CLASSES)
    assert {name: cls.__name__ for name, (_, cls) in queries.ERRORS.items()} == ERROR_CLASSES
    # each error branch is written once, by the table: no document's source spells one out
    import inspect

    assert "... on PythonError" not in inspect.getsource(queries)


def test_each_mutation_asks_for_every_error_its_union_answers() -> None:
    from dagster_graphql.schema import create_schema

    schema = create_schema().graphql_schema
    for name, field in (("ADD_PARTITION", "addDynamicPartition"), ("LAUNCH_RUN", "launchRun"),
                        ("TERMINATE_RUN", "terminateRun"), ("REEXECUTE_RUN", "launchRunReexecution")):
        union = schema.mutation_type.fields[field].type
        union = getattr(union, "of_type", union)
        assert _branches(queries.ALL[name]) == {t.name for t in union.types}, name


@pytest.mark.parametrize("kind, answer, message", [
    ("RunConflict", {"message": "a run of this key exists"}, "RunConflict: a run of this key exists"),
    ("RunConfigValidationInvalid", {"errors": [{"message": "bad", "path": ["ops"]}]},
     "RunConfigValidationInvalid: [{'message': 'bad', 'path': ['ops']}]"),
    ("InvalidStepError", {"invalidStepKey": "nope"},
     "InvalidStepError: {'__typename': 'InvalidStepError', 'invalidStepKey': 'nope'}"),
    ("RunNotFoundError", {"message": "no run x"}, "RunNotFoundError: no run x"),
    ("PythonError", {"message": "boom"}, "PythonError: boom"),
    ("UnauthorizedError", {"message": "no"}, "UnauthorizedError: no"),
    ("SomeNewNotFoundError", {"message": "gone"}, "SomeNewNotFoundError: gone"),  # a type not in the table
    ("SomeNewError", {"message": "odd"}, "SomeNewError: odd"),
])
def test_an_error_answer_raises_its_sdk_error_with_the_servers_message(kind: str, answer: dict, message: str) -> None:
    from envloop_pipelines.sdk import errors
    from envloop_pipelines.sdk.webserver import DagsterWebserver

    expected = ERROR_CLASSES.get(kind) or ("NotFoundError" if kind.endswith("NotFoundError") else "ClientError")
    with pytest.raises(ClientError) as raised:
        DagsterWebserver._ok({"__typename": kind, **answer}, "LaunchRunSuccess")
    assert type(raised.value) is getattr(errors, expected) and str(raised.value) == message
    assert DagsterWebserver._ok({"__typename": "LaunchRunSuccess", "run": {}}, "LaunchRunSuccess")["run"] == {}


# --------------------------------------------------------------------------- the loop recipe override (issue 46)

NAMED = r"unknown recipe override\(s\) \['lrr'\] \(did you mean 'lr' for 'lrr'\?\); allowed: base_model, .*max_steps"


def test_a_remote_override_is_checked_when_the_client_is_built_before_any_request() -> None:
    """A dead URL: any request would raise UnavailableError; the refusal comes first, from the one validator."""
    from envloop_pipelines.sdk.errors import RefusedError

    dead = "http://127.0.0.1:9"
    with pytest.raises(RefusedError, match=NAMED):
        Client(dead, loop_settings={"recipe_overrides": {"lrr": 1e-4}})
    with pytest.raises(RefusedError, match=r"recipe field 'lr': must be a number in \(0.0, 1.0\], got 'fast'"):
        Client(dead, loop_settings={"recipe_overrides": {"lr": "fast"}})
    with pytest.raises(RefusedError, match="recipe_overrides must be a mapping of recipe fields"):  # one spelling
        Client(dead, loop_settings={"recipe_overrides": json.dumps({"max_steps": 2})})
    with pytest.raises(RefusedError, match=r"loop_settings: \['noise_arms'\]: a remote round runs with the "
                                           r"deployment's loop settings .*only recipe_overrides"):
        Client(dead, loop_settings={"noise_arms": 3, "recipe_overrides": {"max_steps": 2}})
    client = Client(dead, loop_settings={"recipe_overrides": {"max_steps": 3}})  # built: nothing asked yet
    assert client._overrides == {"max_steps": 3}
    assert Client(dead, loop_settings={})._loop_run_config() == {}  # no override: the deployment's own runs
