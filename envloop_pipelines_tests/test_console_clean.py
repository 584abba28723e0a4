"""Third-party notes stay off a user's console (``envloop_pipelines/console.py``); the project's own warnings show.

Each case runs in a fresh Python process, so the filters the entry points install are the ones observed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: What a user saw on every demo and ``envloop train`` before the filters (issue 25).
NOISE = ("is_gradient_checkpointing", "BetaWarning", "PreviewWarning", "Setting accelerator to CPU", "Loading weights",
         "MLflow database tables", "Updating database tables")

#: The real sources of the noise: DeepSpeed's accelerator detection, a Dagster ``Output`` with a
#: ``data_version`` (beta), an asset check with a ``partitions_def`` (preview: the round's checks),
#: transformers' deprecated property on a real (tiny) model, MLflow making a fresh SQLite tracking database;
#: then one warning and one log record of the project's own, which must still show.
_EMIT = """
import logging, warnings
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
{install}
from deepspeed.accelerator import get_accelerator
get_accelerator()
import dagster as dg
dg.Output(1, data_version=dg.DataVersion("v1"))
dg.AssetCheckSpec("c", asset="a", partitions_def=dg.StaticPartitionsDefinition(["p"]))
import transformers
model = transformers.BertModel(transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                                       intermediate_size=8, vocab_size=10))
model.is_gradient_checkpointing
import mlflow, tempfile
mlflow.MlflowClient(tracking_uri="sqlite:///" + tempfile.mkdtemp() + "/mlflow.db").search_experiments()
warnings.warn("our own note", UserWarning)
logging.getLogger("envloop_pipelines.core.model.training").warning("our own record")
"""


def _run(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    full_env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)


def test_the_entry_points_filters_drop_the_noise_and_keep_our_own() -> None:
    out = _run(_EMIT.format(install="from envloop_pipelines.console import quiet_third_party; quiet_third_party()"))
    assert out.returncode == 0, out.stderr
    console = out.stdout + out.stderr
    assert not [n for n in NOISE if n in console], console
    assert "our own note" in out.stderr and "our own record" in out.stderr


def test_without_the_filters_the_noise_is_there() -> None:
    """The same sources unfiltered: the test above is not passing because nothing was emitted."""
    out = _run(_EMIT.format(install=""))
    assert out.returncode == 0, out.stderr
    console = out.stdout + out.stderr
    for noise in ("is_gradient_checkpointing", "BetaWarning", "PreviewWarning", "Setting accelerator to CPU",
                  "Creating initial MLflow database tables", "Updating database tables"):
        assert noise in console, (noise, console)


def test_importing_the_sdk_and_core_changes_no_filter_but_definitions_does() -> None:
    """A library user's warnings are theirs: only an entry point (the CLI's main, the code location) installs."""
    probe = ("import logging, os, warnings\n"
             "def ours():\n"
             "    return [f for f in warnings.filters if f[0] == 'ignore' and (\n"
             "        (f[1] is not None and 'is_gradient_checkpointing' in f[1].pattern)\n"
             "        or f[2].__name__ in ('BetaWarning', 'PreviewWarning'))]\n"
             "import envloop_pipelines.sdk, envloop_pipelines.core.progress, envloop_pipelines.cli\n"
             "assert not ours(), ours()\n"
             "assert not logging.getLogger('DeepSpeed').filters and 'HF_HUB_DISABLE_PROGRESS_BARS' not in os.environ\n"
             "import envloop_pipelines.definitions\n"
             "assert len(ours()) == 3 and logging.getLogger('DeepSpeed').filters, ours()\n"
             "print('ok')\n")
    out = _run(probe)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_envloop_train_prints_json_only_and_no_third_party_notes(tmp_path: Path) -> None:
    """``envloop train`` loads the encoder, trains with the HF Trainer (DeepSpeed integration imported): stdout is
    the JSON document alone, stderr the progress and the project's own warnings."""
    env = {"ENVLOOP_HOME": str(tmp_path / "home"), "ENVLOOP_PROGRESS": "log"}
    envloop = str(Path(sys.executable).with_name("envloop"))
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env}
    full_env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    gen = subprocess.run([envloop, "data", "generate", "--users", "20", "--records-per-user", "3"],
                         capture_output=True, text=True, timeout=300, env=full_env)
    assert gen.returncode == 0, gen.stderr
    out = subprocess.run([envloop, "train", "--task", "personal_agent", "--recipe", "packaged:decision_head_cpu.yaml",
                          "--out", str(tmp_path / "ckpt"), "--recipe-override", "max_steps=2",
                          "--recipe-override", "max_length=128"],
                         capture_output=True, text=True, timeout=600, env=full_env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["checkpoint"] == str(tmp_path / "ckpt")  # the whole of stdout is the document
    assert not [n for n in NOISE if n in out.stdout + out.stderr], out.stderr
    assert "truncated to max_length=128" in out.stderr  # the project's own warning still shows


def test_every_bench_installs_the_filters_before_it_runs() -> None:
    """The benches are entry points too: their output is pasted into notes, so a library's notes on itself are
    dropped there as in ``envloop`` (``bench_aa`` printed DeepSpeed's accelerator line and the
    ``is_gradient_checkpointing`` FutureWarning before)."""
    import ast

    benches = sorted((Path(__file__).resolve().parents[1] / "bench").glob("bench_*.py"))
    assert benches
    for path in benches:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        main_blocks = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        assert main_blocks, f"{path.name} has no __main__ block"
        calls = [ast.unparse(n.func) for n in ast.walk(main_blocks[0]) if isinstance(n, ast.Call)]
        assert "quiet_third_party" in calls and calls.index("quiet_third_party") < calls.index("main"), (path.name, calls)


def test_importing_a_dagster_bench_prints_no_dagster_note() -> None:
    """A bench installs the filters in its ``__main__`` block, after its module-level imports ran: a module that
    warns when imported (``defs/rounds/checks.py``: ``partitions_def`` on an asset check is a preview) is imported
    inside ``main`` instead (``bench_round`` printed the PreviewWarning before each run)."""
    import ast

    benches = [path for path in sorted((Path(__file__).resolve().parents[1] / "bench").glob("bench_*.py"))
               if any(isinstance(node, (ast.Import, ast.ImportFrom)) and re.search(r"\bdagster\b|envloop_pipelines\.def",
                                                                                  ast.unparse(node))
                      for node in ast.parse(path.read_text(encoding="utf-8")).body)]
    assert "bench_round.py" in [p.name for p in benches]  # the round's checks and assets, through Dagster
    for path in benches:
        out = _run("import importlib.util\n"
                   f"spec = importlib.util.spec_from_file_location('bench', {str(path)!r})\n"
                   "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n")
        assert out.returncode == 0, out.stderr
        assert not [n for n in NOISE if n in out.stdout + out.stderr], (path.name, out.stderr)


def test_mlflows_run_links_stay_off_stdout_at_an_entry_point_only() -> None:
    """MLflow writes "View run ... at:" to stdout when a run on a tracking server ends (``envloop round cancel
    --remote`` closing the round's run printed it, breaking JSON output); the entry points switch it off, a
    library user keeps it."""
    probe = ("import os\n"
             "from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT as suppress\n"
             "import envloop_pipelines.sdk\n"
             "assert not suppress.get()\n"
             "from envloop_pipelines.console import quiet_third_party; quiet_third_party()\n"
             "assert suppress.get()\n"
             "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    own = subprocess.run([sys.executable, "-c", "import os\nos.environ['MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT']"
                          " = 'false'\nfrom envloop_pipelines.console import quiet_third_party; quiet_third_party()\n"
                          "print(os.environ['MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT'])"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert own.stdout.strip() == "false", own.stderr
