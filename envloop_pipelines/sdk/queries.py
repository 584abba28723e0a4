"""The GraphQL documents the SDK sends to the Dagster webserver (``POST <url>/graphql``).

The same requests, written as curl commands, are in ``docs/http-api.md``; a test runs those as
written against a real webserver, and another checks that each document here is accepted by the
webserver's own schema.
"""

from __future__ import annotations

#: The code locations and repositories, with their jobs (to find the one that holds ``round_job``).
REPOSITORIES = """
query Repositories {
  repositoriesOrError {
    __typename
    ... on RepositoryConnection { nodes { name location { name } jobs { name } } }
    ... on PythonError { message }
  }
}
"""

#: The configured values of the code location's top-level resources (the loop's settings).
RESOURCES = """
query Resources($repo: RepositorySelector!) {
  repositoryOrError(repositorySelector: $repo) {
    __typename
    ... on Repository { allTopLevelResourceDetails { name configuredValues { key value type } } }
    ... on PythonError { message }
    ... on RepositoryNotFoundError { message }
  }
}
"""

#: The ops (steps) of a job: the denominator of a run's progress.
JOB_STEPS = """
query JobSteps($job: PipelineSelector!) {
  pipelineOrError(params: $job) {
    __typename
    ... on Pipeline { solids { name } }
    ... on PipelineNotFoundError { message }
    ... on PythonError { message }
  }
}
"""

#: The keys of a dynamic partitions definition, read through one asset that uses it.
PARTITION_KEYS = """
query PartitionKeys($asset: AssetKeyInput!) {
  assetNodeOrError(assetKey: $asset) {
    __typename
    ... on AssetNode { partitionKeys }
    ... on AssetNotFoundError { message }
  }
}
"""

ADD_PARTITION = """
mutation AddPartition($repo: RepositorySelector!, $partitions: String!, $key: String!) {
  addDynamicPartition(repositorySelector: $repo, partitionsDefName: $partitions, partitionKey: $key) {
    __typename
    ... on AddDynamicPartitionSuccess { partitionsDefName partitionKey }
    ... on DuplicateDynamicPartitionError { partitionName }
    ... on UnauthorizedError { message }
    ... on PythonError { message }
  }
}
"""

LAUNCH_RUN = """
mutation LaunchRun($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on RunConfigValidationInvalid { errors { message path } }
    ... on InvalidSubsetError { message }
    ... on PipelineNotFoundError { message }
    ... on RunConflict { message }
    ... on UnauthorizedError { message }
    ... on PresetNotFoundError { message }
    ... on ConflictingExecutionParamsError { message }
    ... on NoModeProvidedError { message }
    ... on InvalidStepError { invalidStepKey }
    ... on InvalidOutputError { stepKey invalidOutputName }
    ... on PythonError { message }
  }
}
"""

_RUN_FIELDS = """
      runId jobName status startTime endTime creationTime stepKeysToExecute
      tags { key value }
      stepStats { stepKey status startTime endTime }
"""

RUN = """
query Run($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run {%s}
    ... on RunNotFoundError { message }
    ... on PythonError { message }
  }
}
""" % _RUN_FIELDS

#: Runs of a job, newest first, optionally of one partition (the tag ``dagster/partition``).
RUNS = """
query Runs($filter: RunsFilter!, $limit: Int) {
  runsOrError(filter: $filter, limit: $limit) {
    __typename
    ... on Runs { results {%s} }
    ... on InvalidPipelineRunsFilterError { message }
    ... on PythonError { message }
  }
}
""" % _RUN_FIELDS

#: The log messages of a run after a cursor (the progress lines of its steps).
RUN_LOGS = """
query RunLogs($runId: ID!, $after: String) {
  logsForRun(runId: $runId, afterCursor: $after) {
    __typename
    ... on EventConnection {
      cursor hasMore
      events { __typename ... on MessageEvent { message stepKey level timestamp } }
    }
    ... on RunNotFoundError { message }
    ... on PythonError { message }
  }
}
"""

_ERROR = "message className errorChain { error { message className } }"

#: The failure events of a run: each failed step's error (its own message is the last link of
#: ``errorChain``; a ``dagster.Failure`` gives it as ``failureMetadata.description``) and the run's failure.
RUN_FAILURES = """
query RunFailures($runId: ID!, $after: String) {
  logsForRun(runId: $runId, afterCursor: $after) {
    __typename
    ... on EventConnection {
      cursor hasMore
      events {
        __typename
        ... on ExecutionStepFailureEvent { stepKey message error { %s } failureMetadata { description } }
        ... on RunFailureEvent { message error { %s } }
        ... on MessageEvent { message stepKey level timestamp }
      }
    }
    ... on RunNotFoundError { message }
    ... on PythonError { message }
  }
}
""" % (_ERROR, _ERROR)

#: Cancel a run (the run's steps are interrupted; ``MARK_AS_CANCELED_IMMEDIATELY`` for a run whose worker is gone).
TERMINATE_RUN = """
mutation TerminateRun($runId: String!, $policy: TerminateRunPolicy) {
  terminateRun(runId: $runId, terminatePolicy: $policy) {
    __typename
    ... on TerminateRunSuccess { run { runId status } }
    ... on TerminateRunFailure { message run { runId status } }
    ... on RunNotFoundError { message }
    ... on UnauthorizedError { message }
    ... on PythonError { message }
  }
}
"""

#: Run a failed run again (Dagster's re-execution: ``FROM_FAILURE`` reuses the steps that succeeded).
REEXECUTE_RUN = """
mutation ReexecuteRun($params: ReexecutionParams!) {
  launchRunReexecution(reexecutionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on RunConfigValidationInvalid { errors { message path } }
    ... on PipelineNotFoundError { message }
    ... on RunConflict { message }
    ... on UnauthorizedError { message }
    ... on InvalidStepError { invalidStepKey }
    ... on InvalidOutputError { stepKey invalidOutputName }
    ... on PythonError { message }
  }
}
"""

_METADATA = """
        metadataEntries {
          label __typename
          ... on JsonMetadataEntry { jsonString }
          ... on TextMetadataEntry { text }
          ... on FloatMetadataEntry { floatValue }
          ... on IntMetadataEntry { intValue }
          ... on BoolMetadataEntry { boolValue }
          ... on MarkdownMetadataEntry { mdStr }
          ... on UrlMetadataEntry { url }
          ... on PathMetadataEntry { path }
        }
"""

#: Materializations of an asset, newest first (of some partitions, or all); the decisions, cards and ledger events.
MATERIALIZATIONS = """
query Materializations($asset: AssetKeyInput!, $partitions: [String!], $limit: Int) {
  assetOrError(assetKey: $asset) {
    __typename
    ... on Asset {
      assetMaterializations(partitions: $partitions, limit: $limit) {
        runId partition timestamp%s
      }
    }
    ... on AssetNotFoundError { message }
  }
}
""" % _METADATA

ALL = {"REPOSITORIES": REPOSITORIES, "RESOURCES": RESOURCES, "JOB_STEPS": JOB_STEPS, "PARTITION_KEYS": PARTITION_KEYS,
       "ADD_PARTITION": ADD_PARTITION, "LAUNCH_RUN": LAUNCH_RUN, "RUN": RUN, "RUNS": RUNS, "RUN_LOGS": RUN_LOGS,
       "MATERIALIZATIONS": MATERIALIZATIONS, "RUN_FAILURES": RUN_FAILURES, "TERMINATE_RUN": TERMINATE_RUN,
       "REEXECUTE_RUN": REEXECUTE_RUN}
