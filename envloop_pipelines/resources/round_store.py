"""The IO manager of the decision loop's steps: typed values stored as JSON in the loop's ``RoundStore``.

Each asset returns a frozen record (``core/decision_loop/step_records.py``); this IO manager
writes it to ``<home>/loops/<task>/rounds/<round>/<asset>.json`` (or
``<home>/loops/<task>/<asset>.json`` for an unpartitioned asset) and loads it
back, by the record type registered for the asset, for every downstream asset
and check. The files live under the EnvLoop home, so steps in other processes
(the multiprocess executor) or pods (``k8s_job_executor`` with the home on a
shared volume) read what upstream steps wrote. The machinery is the RL round's too
(``resources/settings.py``: ``StepStoreIOManager``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from envloop_pipelines.core.decision_loop.step_records import STEP_RECORDS
from envloop_pipelines.resources.loop import LoopResource
from envloop_pipelines.resources.settings import StepStoreIOManager


class RoundStoreIOManager(StepStoreIOManager):
    """Round step values as JSON in the loop's store (see the module docstring)."""

    RECORDS: ClassVar[Any] = STEP_RECORDS
    RECORDS_WHERE: ClassVar[str] = "core/decision_loop/step_records.STEP_RECORDS"

    loop: LoopResource  # type: ignore[valid-type]

    def settings(self) -> Any:
        return self.loop
