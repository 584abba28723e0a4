"""The GraphQL documents the SDK sends to the Dagster webserver (``POST <url>/graphql``), and what each error
answer of theirs means to the SDK.

Every field of Dagster's GraphQL API answers a union: its success type or one of several error types. The error
types are spelled once, in :data:`ERRORS` (the fields a document reads of each, and the SDK error it raises), and
a document names only its field, its success branch and the error types its union has (:func:`document`);
:func:`error_class` is the one mapping from an answer's ``__typename`` to the SDK's error.

The same requests, written as curl commands, are in ``docs/http-api.md``; a test runs those as
written against a real webserver, and another checks that each document here is accepted by the
webserver's own schema.
"""

from __future__ import annotations

from collections.abc import Sequence

from envloop_pipelines.sdk.errors import ClientError, NotFoundError, RefusedError

#: Dagster's GraphQL error types the documents ask for: ``(fields read, SDK error raised)``. Bad input (config,
#: a step, a key that exists, a conflicting run) is a :class:`RefusedError`; a missing thing a
#: :class:`NotFoundError`; the rest (the server's own error, a refused authorization) a :class:`ClientError`.
ERRORS: dict[str, tuple[str, type[ClientError]]] = {
    "PythonError": ("message", ClientError),
    "UnauthorizedError": ("message", ClientError),
    "InvalidSubsetError": ("message", ClientError),
    "ConflictingExecutionParamsError": ("message", ClientError),
    "NoModeProvidedError": ("message", ClientError),
    "InvalidPipelineRunsFilterError": ("message", ClientError),
    "TerminateRunFailure": ("message run { runId status }", ClientError),
    "RunConfigValidationInvalid": ("errors { message path }", RefusedError),
    "RunConflict": ("message", RefusedError),
    "InvalidStepError": ("invalidStepKey", RefusedError),
    "InvalidOutputError": ("stepKey invalidOutputName", RefusedError),
    "DuplicateDynamicPartitionError": ("partitionName", RefusedError),
    "PipelineNotFoundError": ("message", NotFoundError),
    "PresetNotFoundError": ("message", NotFoundError),
    "RunNotFoundError": ("message", NotFoundError),
    "RepositoryNotFoundError": ("message", NotFoundError),
    "AssetNotFoundError": ("message", NotFoundError),
}

#: The error types of a launch (``launchRun`` and ``launchRunReexecution`` answer the same union).
LAUNCH_ERRORS = ("RunConfigValidationInvalid", "InvalidSubsetError", "PipelineNotFoundError", "RunConflict",
                 "UnauthorizedError", "PresetNotFoundError", "ConflictingExecutionParamsError", "NoModeProvidedError",
                 "InvalidStepError", "InvalidOutputError", "PythonError")


def error_class(typename: str | None) -> type[ClientError]:
    """The SDK error an answer of type ``typename`` raises (:data:`ERRORS`); a type not listed there is a
    :class:`NotFoundError` when Dagster names it ``...NotFoundError``, else a :class:`ClientError`."""
    if typename in ERRORS:
        return ERRORS[typename][1]
    return NotFoundError if str(typename).endswith("NotFoundError") else ClientError


def document(operation: str, field: str, success: str | Sequence[str], errors: Sequence[str]) -> str:
    """A GraphQL document: ``operation`` (``query Name($x: T!)`` or ``mutation ...``) asking ``field`` (with its
    arguments) for ``__typename``, the success branch(es) (``Type { fields }``) and each error type of ``errors``
    with the fields :data:`ERRORS` reads of it.

    Raises:
        KeyError: an error type :data:`ERRORS` does not spell.
    """
    branches = [success] if isinstance(success, str) else list(success)
    branches += [f"{name} {{ {ERRORS[name][0]} }}" for name in errors]
    body = "\n".join(f"    ... on {b}" for b in branches)
    return f"\n{operation} {{\n  {field} {{\n    __typename\n{body}\n  }}\n}}\n"


#: The code locations and repositories, with their jobs (to find the one that holds ``round_job``).
REPOSITORIES = document("query Repositories", "repositoriesOrError",
                        "RepositoryConnection { nodes { name location { name } jobs { name } } }", ["PythonError"])

#: The configured values of the code location's top-level resources (the loop's settings).
RESOURCES = document("query Resources($repo: RepositorySelector!)", "repositoryOrError(repositorySelector: $repo)",
                     "Repository { allTopLevelResourceDetails { name configuredValues { key value type } } }",
                     ["PythonError", "RepositoryNotFoundError"])

#: The ops (steps) of a job: the denominator of a run's progress.
JOB_STEPS = document("query JobSteps($job: PipelineSelector!)", "pipelineOrError(params: $job)",
                     "Pipeline { solids { name } }", ["PipelineNotFoundError", "PythonError"])

#: The keys of a dynamic partitions definition, read through one asset that uses it.
PARTITION_KEYS = document("query PartitionKeys($asset: AssetKeyInput!)", "assetNodeOrError(assetKey: $asset)",
                          "AssetNode { partitionKeys }", ["AssetNotFoundError"])

ADD_PARTITION = document(
    "mutation AddPartition($repo: RepositorySelector!, $partitions: String!, $key: String!)",
    "addDynamicPartition(repositorySelector: $repo, partitionsDefName: $partitions, partitionKey: $key)",
    "AddDynamicPartitionSuccess { partitionsDefName partitionKey }",
    ["DuplicateDynamicPartitionError", "UnauthorizedError", "PythonError"])

LAUNCH_RUN = document("mutation LaunchRun($params: ExecutionParams!)", "launchRun(executionParams: $params)",
                      "LaunchRunSuccess { run { runId status } }", LAUNCH_ERRORS)

_RUN_FIELDS = ("runId jobName status startTime endTime creationTime stepKeysToExecute tags { key value } "
               "stepStats { stepKey status startTime endTime }")

RUN = document("query Run($runId: ID!)", "runOrError(runId: $runId)", f"Run {{ {_RUN_FIELDS} }}",
               ["RunNotFoundError", "PythonError"])

#: Runs of a job, newest first, optionally of one partition (the tag ``dagster/partition``).
RUNS = document("query Runs($filter: RunsFilter!, $limit: Int)", "runsOrError(filter: $filter, limit: $limit)",
                f"Runs {{ results {{ {_RUN_FIELDS} }} }}", ["InvalidPipelineRunsFilterError", "PythonError"])

#: The log messages of a run after a cursor (the progress lines of its steps).
RUN_LOGS = document(
    "query RunLogs($runId: ID!, $after: String)", "logsForRun(runId: $runId, afterCursor: $after)",
    "EventConnection { cursor hasMore events { __typename ... on MessageEvent { message stepKey level timestamp } } }",
    ["RunNotFoundError", "PythonError"])

_ERROR = "message className errorChain { error { message className } }"

#: The failure events of a run: each failed step's error (its own message is the last link of
#: ``errorChain``; a ``dagster.Failure`` gives it as ``failureMetadata.description``) and the run's failure.
RUN_FAILURES = document(
    "query RunFailures($runId: ID!, $after: String)", "logsForRun(runId: $runId, afterCursor: $after)",
    "EventConnection { cursor hasMore events { __typename"
    f" ... on ExecutionStepFailureEvent {{ stepKey message error {{ {_ERROR} }} failureMetadata {{ description }} }}"
    f" ... on RunFailureEvent {{ message error {{ {_ERROR} }} }}"
    " ... on MessageEvent { message stepKey level timestamp } } }",
    ["RunNotFoundError", "PythonError"])

#: Cancel a run (the run's steps are interrupted; ``MARK_AS_CANCELED_IMMEDIATELY`` for a run whose worker is gone).
TERMINATE_RUN = document("mutation TerminateRun($runId: String!, $policy: TerminateRunPolicy)",
                         "terminateRun(runId: $runId, terminatePolicy: $policy)",
                         "TerminateRunSuccess { run { runId status } }",
                         ["TerminateRunFailure", "RunNotFoundError", "UnauthorizedError", "PythonError"])

#: Run a failed run again (Dagster's re-execution: ``FROM_FAILURE`` reuses the steps that succeeded).
REEXECUTE_RUN = document("mutation ReexecuteRun($params: ReexecutionParams!)",
                         "launchRunReexecution(reexecutionParams: $params)",
                         "LaunchRunSuccess { run { runId status } }", LAUNCH_ERRORS)

_METADATA = ("metadataEntries { label __typename ... on JsonMetadataEntry { jsonString } "
             "... on TextMetadataEntry { text } ... on FloatMetadataEntry { floatValue } "
             "... on IntMetadataEntry { intValue } ... on BoolMetadataEntry { boolValue } "
             "... on MarkdownMetadataEntry { mdStr } ... on UrlMetadataEntry { url } "
             "... on PathMetadataEntry { path } }")

#: Materializations of an asset, newest first (of some partitions, or all); the decisions, cards and ledger events.
MATERIALIZATIONS = document(
    "query Materializations($asset: AssetKeyInput!, $partitions: [String!], $limit: Int)",
    "assetOrError(assetKey: $asset)",
    "Asset { assetMaterializations(partitions: $partitions, limit: $limit) "
    f"{{ runId partition timestamp {_METADATA} }} }}",
    ["AssetNotFoundError"])

ALL = {"REPOSITORIES": REPOSITORIES, "RESOURCES": RESOURCES, "JOB_STEPS": JOB_STEPS, "PARTITION_KEYS": PARTITION_KEYS,
       "ADD_PARTITION": ADD_PARTITION, "LAUNCH_RUN": LAUNCH_RUN, "RUN": RUN, "RUNS": RUNS, "RUN_LOGS": RUN_LOGS,
       "MATERIALIZATIONS": MATERIALIZATIONS, "RUN_FAILURES": RUN_FAILURES, "TERMINATE_RUN": TERMINATE_RUN,
       "REEXECUTE_RUN": REEXECUTE_RUN}
