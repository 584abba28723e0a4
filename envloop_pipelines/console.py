"""Third-party noise kept out of a user's console: one list, installed by the entry points only.

A person running ``envloop`` or a Dagster code location of this package cannot act on a library's
note about its own internals, so these are dropped where they arise:

* ``transformers``: the ``FutureWarning`` that ``is_gradient_checkpointing`` is deprecated (raised in
  ``transformers.modeling_utils`` when the Trainer asks the model), and its ``Loading weights`` bars
  (Hugging Face's progress bars; ``HF_HUB_DISABLE_PROGRESS_BARS=0`` brings them back).
* In a Jupyter kernel (``examples/loop_sdk.ipynb``): tqdm's ``TqdmWarning`` that ipywidgets is missing (the
  loop's progress is lines there), and the ``RuntimeWarning`` that an in-process Dagster run's
  ``shutdown_asyncgens`` coroutine was never awaited (the kernel runs an event loop of its own).
* Dagster: ``BetaWarning`` and ``PreviewWarning``, Dagster's notes that a parameter the loop uses
  (``data_version`` on an ``Output``, say, or ``partitions_def`` on the round's asset checks, which warns
  when ``defs/rounds/checks.py`` is imported) is not yet stable.
* MLflow: the "🏃 View run … at: …" and "🧪 View experiment at: …" lines it writes to stdout when a run on a
  tracking server ends (a cancelled round's run, say), which would break a command's JSON; set
  ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=false`` to bring them back.
* MLflow: its "Downloading artifacts" bars (``Client.fetch_checkpoint``); set
  ``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=true`` to bring them back.
* MLflow: "Creating initial MLflow database tables..." and "Updating database tables", the INFO lines its
  SQLite store prints when a fresh home's tracking database is made (the first command of every demo).
* DeepSpeed: "Setting accelerator to CPU" from ``real_accelerator.py`` on the logger ``DeepSpeed``
  (which prints to stdout, where it would break a command's JSON).

Each filter names its category and module, or its logger and source file, so the project's own
warnings and every other library's still show. :func:`quiet_third_party` is called by the CLI's
``main``, at the top of ``envloop_pipelines.definitions`` (the code location, its run and step
processes), by the LocalClient's round worker (``sdk/worker.py``), by each ``bench/`` script's ``__main__`` block, and by the
SDK's calls that load a model or a checkpoint (``predict`` answered in process, ``Client.fetch_checkpoint``), so a
notebook sees what the CLI shows; importing the package, the SDK or ``core`` changes nothing for a library user.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

#: (message regex, category name, module regex) of the Python warnings dropped; Dagster's are matched by category.
WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
    # in a Jupyter kernel: tqdm's note that ipywidgets is missing (the loop prints lines there, not widgets) ...
    (r"IProgress not found", Warning, r"tqdm\.auto"),
    # ... and an in-process Dagster run's event loop note (ipykernel runs one of its own)
    (r"coroutine 'BaseEventLoop\.shutdown_asyncgens' was never awaited", RuntimeWarning,
     r"dagster\._core\.execution\.context_creation_job"),
)
#: (logger name, source file, message prefix) of the log records dropped.
LOG_RECORDS: tuple[tuple[str, str, str], ...] = (
    ("DeepSpeed", "real_accelerator.py", "Setting accelerator to CPU"),
    ("mlflow.store.db.utils", "utils.py", "Creating initial MLflow database tables"),
    ("mlflow.store.db.utils", "utils.py", "Updating database tables"),
)
#: MLflow's switch for its run and experiment links on stdout; set to true unless the user set it.
MLFLOW_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
#: MLflow's switch for its artifact download and upload bars; set to false unless the user set it.
MLFLOW_ARTIFACT_BARS_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
#: The environment variable of Hugging Face's progress bars (``Loading weights``); set to 1 unless the user set it.
HF_PROGRESS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"


class _DropRecords(logging.Filter):
    """Drops the records of :data:`LOG_RECORDS` from the logger it is added to."""

    def __init__(self, filename: str, prefix: str) -> None:
        super().__init__()
        self.filename, self.prefix = filename, prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.filename == self.filename and str(record.msg).startswith(self.prefix))


def _dagster_categories() -> tuple[type[Warning], ...]:
    try:
        from dagster_shared.utils.warnings import BetaWarning, PreviewWarning
    except ImportError:  # pragma: no cover - dagster is a dependency
        return ()
    return BetaWarning, PreviewWarning


def quiet_third_party() -> None:
    """Install the filters of this module (idempotent): call it once at an entry point, before the heavy imports."""
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for category in _dagster_categories():
        warnings.filterwarnings("ignore", category=category)
    for name, filename, prefix in LOG_RECORDS:
        logger = logging.getLogger(name)
        installed = [(f.filename, f.prefix) for f in logger.filters if isinstance(f, _DropRecords)]
        if (filename, prefix) not in installed:
            logger.addFilter(_DropRecords(filename, prefix))
    os.environ.setdefault(MLFLOW_URL_ENV, "true")  # read when a run ends; child processes inherit it
    os.environ.setdefault(MLFLOW_ARTIFACT_BARS_ENV, "false")  # read at each download
    if os.environ.get(HF_PROGRESS_ENV) is None:
        os.environ[HF_PROGRESS_ENV] = "1"  # read when huggingface_hub is imported; child processes inherit it
        if "transformers.utils.logging" in sys.modules:  # already imported: its bars were switched on then
            sys.modules["transformers.utils.logging"].disable_progress_bar()
        if "huggingface_hub.utils" in sys.modules:
            sys.modules["huggingface_hub.utils"].disable_progress_bars()


__all__ = ["HF_PROGRESS_ENV", "LOG_RECORDS", "MLFLOW_ARTIFACT_BARS_ENV", "MLFLOW_URL_ENV", "WARNINGS", "quiet_third_party"]
