"""The Python SDK: drive an EnvLoop deployment (its Dagster webserver and MLflow server) from code.

``Client(dagster_url, mlflow_uri)`` drives a deployment and ``LocalClient(loop_settings)`` this process and
home; both are a :class:`~envloop_pipelines.sdk.protocol.LoopClient`. ``Client`` starts rounds and loops,
follows them with progress, and reads rounds, decisions, the ledger, releases, cards and checkpoints. See
:mod:`envloop_pipelines.sdk.client` and ``docs/http-api.md`` (the same requests over plain HTTP). Each name is
defined in one module of the package (``errors``, ``records``, ``client``, ``local``, ``protocol``); a user
imports it from here.
"""

from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import (
    BusyError,
    ClientError,
    NotFoundError,
    PromotionOutOfReach,
    RefusedError,
    RoundFailed,
    UnavailableError,
)
from envloop_pipelines.sdk.local import LocalClient
from envloop_pipelines.sdk.protocol import LoopClient
from envloop_pipelines.sdk.records import ReleaseInfo, RoundInfo, RoundRun, RunError, RunInfo, StepInfo

__all__ = ["BusyError", "Client", "ClientError", "LocalClient", "LoopClient", "NotFoundError", "PromotionOutOfReach", "RefusedError", "ReleaseInfo", "RoundFailed", "RoundInfo", "RoundRun",
           "RunError", "RunInfo", "StepInfo", "UnavailableError"]
