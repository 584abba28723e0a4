"""The code that was written twice and had drifted, now written once (issue 25).

Each test shows the one behaviour both former copies now share: the Trainer arguments of the decision
model and of causal SFT, the two recipe classes' trainer fields, the policy's rendering and loading, the
servers' auth, chat body and runner, and the prediction table of the model and of the TF-IDF baseline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from envloop_pipelines.core.model.causal_sft import CausalSftRecipe
from envloop_pipelines.core.model.recipe import Recipe, RecipeError, TrainerFields, recipe_from_dict
from envloop_pipelines_tests.core.test_model_data import make_table

REPO = Path(__file__).resolve().parents[2]
SHARED = {"lr": 5e-4, "epochs": 2, "max_steps": 7, "batch_size": 4, "grad_accum": 2, "weight_decay": 0.0,
          "warmup_ratio": 0.1, "lr_scheduler": "cosine", "max_grad_norm": 0.5, "seed": 3, "precision": "bf16"}


def _local_lm(tmp_path: Path) -> str:
    (tmp_path / "lm").mkdir(exist_ok=True)
    (tmp_path / "lm" / "config.json").write_text("{}")
    return str(tmp_path / "lm")


# --------------------------------------------------------------------------- Trainer arguments


@pytest.mark.parametrize("bf16_units", [False, True])
def test_both_trainers_get_their_arguments_from_the_one_builder(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch, bf16_units: bool) -> None:
    """The same trainer fields give the same TrainingArguments (bf16 kept on a CPU with bf16 units, dropped with
    the same log line on one without); only the labels and whether every step's loss is logged differ, and they
    are the builder's arguments."""
    from envloop_pipelines.core.model import training
    from envloop_pipelines.core.model.training import trainer_arguments

    monkeypatch.setattr(training, "cpu_bf16", lambda: bf16_units)
    decision = Recipe(**SHARED)
    causal = CausalSftRecipe(base_model=_local_lm(tmp_path), **SHARED)
    with caplog.at_level("INFO", logger="envloop_pipelines.core.model.training"):
        a = trainer_arguments(decision, str(tmp_path / "a"), label_names=["targets"]).to_dict()
        b = trainer_arguments(causal, str(tmp_path / "a"), label_names=["labels"], log_every_step=True).to_dict()
    assert caplog.text.count("recipe.precision=bf16 ignored: this CPU has no bf16 units") == (0 if bf16_units else 2)
    differ = {k for k in a if a[k] != b[k]}
    assert differ == {"label_names", "logging_strategy", "logging_steps"}
    assert (a["label_names"], b["label_names"]) == (["targets"], ["labels"])
    assert str(a["logging_strategy"]).endswith("no") and str(b["logging_strategy"]).endswith("steps")
    assert b["logging_steps"] == 1 and a["bf16"] is b["bf16"] is bf16_units and a["use_cpu"] and b["use_cpu"]
    assert (a["learning_rate"], a["max_steps"], a["gradient_accumulation_steps"], a["seed"]) == (5e-4, 7, 2, 3)


def test_causal_sft_has_no_trainer_arguments_of_its_own() -> None:
    from envloop_pipelines.core.model import causal_sft

    assert not hasattr(causal_sft, "_training_arguments")
    assert "trainer_arguments(" in Path(causal_sft.__file__).read_text()


# --------------------------------------------------------------------------- the recipes' shared fields


def test_both_recipes_share_the_trainer_fields_and_their_checks(tmp_path: Path) -> None:
    lm = _local_lm(tmp_path)
    shared = {f.name for f in TrainerFields.__dataclass_fields__.values()}
    assert shared <= set(Recipe.__dataclass_fields__) and shared == set(CausalSftRecipe.__dataclass_fields__)
    for name, bad in (("epochs", 0), ("lr", 2.0), ("lr_scheduler", "cyclic"), ("precision", "fp8"),
                      ("gradient_checkpointing", "yes"), ("deepspeed", "packaged:nope.json")):
        with pytest.raises(RecipeError) as decision_error:
            recipe_from_dict({name: bad})
        with pytest.raises(RecipeError) as causal_error:
            CausalSftRecipe.from_dict({"base_model": lm, name: bad})
        assert str(decision_error.value) == str(causal_error.value)
        assert str(decision_error.value).startswith(f"recipe field {name!r}: must be")


def test_each_recipe_keeps_its_keys_defaults_and_messages(tmp_path: Path) -> None:
    lm = _local_lm(tmp_path)
    assert (Recipe().lr, Recipe().lr_scheduler, Recipe().batch_size) == (1e-3, "linear", 16)
    causal = CausalSftRecipe(base_model=lm)
    assert (causal.lr, causal.lr_scheduler, causal.batch_size, causal.max_length) == (2e-4, "cosine", 8, 1024)
    with pytest.raises(RecipeError, match=r"unknown causal-SFT recipe key\(s\) \['readout'\]"):
        CausalSftRecipe.from_dict({"base_model": lm, "readout": "label_token"})
    with pytest.raises(RecipeError, match=r"unknown recipe key\(s\) \['bogus'\]"):
        recipe_from_dict({"bogus": 1})
    with pytest.raises(RecipeError, match="'base_model': required"):
        CausalSftRecipe.from_dict({"lr": 1e-4})
    assert causal.replace(lora={"r": 4}).lora.r == 4 and Recipe().replace(lora={"r": 4}).lora.r == 4


def test_a_causal_recipe_hashes_a_whole_number_as_its_float(tmp_path: Path) -> None:
    """Drift fixed: the decision recipe stored ``weight_decay: 0`` as 0.0, the causal-SFT recipe kept the int,
    so ``weight_decay: 0`` and ``weight_decay: 0.0`` were two causal recipes with two hashes."""
    lm = _local_lm(tmp_path)
    as_int = CausalSftRecipe.from_dict({"base_model": lm, "weight_decay": 0, "lr": 1, "max_grad_norm": 2})
    as_float = CausalSftRecipe.from_dict({"base_model": lm, "weight_decay": 0.0, "lr": 1.0, "max_grad_norm": 2.0})
    assert as_int == as_float and as_int.hash == as_float.hash
    assert isinstance(as_int.to_dict()["weight_decay"], float)


def test_the_recipes_keep_their_hashes(tmp_path: Path) -> None:
    """The merge changes no recipe's identity (hashes as computed before it; sorted JSON, so the new field
    order does not count, and the shipped recipe's values were floats already)."""
    from envloop_pipelines.core.model.recipe import load_recipe
    from envloop_pipelines.core.model.recipe import recipe_hash

    recipe = load_recipe("packaged:causal_sft_qwen_gpu.yaml", kind=CausalSftRecipe)
    assert recipe.hash == "921fe6f41e3d25fb4340bede8124baa0e755d11569679505fcc98616d786a3a8"
    assert CausalSftRecipe(base_model="/tmp").hash == "e6cdcee992c4260f923e892118e382858dc03a4c43e042bca493aa313e8e3aa4"
    assert CausalSftRecipe.from_dict(recipe.to_dict()).hash == recipe.hash
    assert recipe_hash(Recipe()) == "fbf552c34d445801b9830c9d6fa8179d5b93368ab3ee49625d13a59718dc379c"


# --------------------------------------------------------------------------- the policy's rendering and loading


def test_training_and_serving_render_with_the_one_policy_module() -> None:
    from envloop_pipelines.core.model import causal_sft, policy

    for name in ("render", "load_policy", "load_tokenizer", "read_policy_checkpoint", "ChatTemplateError"):
        assert getattr(causal_sft, name) is getattr(policy, name)
    source = (REPO / "envloop_pipelines" / "core" / "serve" / "generation.py").read_text()
    assert "core.model.causal_sft import" not in source and "_Auth" not in source


def test_serving_a_policy_does_not_load_the_decision_server() -> None:
    code = ("import sys, envloop_pipelines.core.serve.generation as g; "
            "print(sorted(m for m in ('envloop_pipelines.core.serve.app', 'envloop_pipelines.core.model.causal_sft', "
            "'envloop_pipelines.core.model.predict') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- auth, chat body, runner


def test_both_servers_use_one_auth_and_one_chat_body() -> None:
    from envloop_pipelines.core.serve import app, generation, http

    assert app.Auth is generation.Auth is http.Auth
    assert app.chat_completion_body is generation.chat_completion_body is http.chat_completion_body
    body = http.chat_completion_body(completion_id="x1", model="m", fingerprint="0123456789abcdef",
                                     message={"role": "assistant", "content": "a", "refusal": None},
                                     finish_reason="stop", prompt_tokens=5, completion_tokens=2, x_extra=1)
    assert body["id"] == "chatcmpl-x1" and body["object"] == "chat.completion"
    assert body["system_fingerprint"] == "envloop-0123456789ab" and body["x_extra"] == 1
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "a", "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert http.chat_completion_body(completion_id="y", model="m", fingerprint=None, message={},
                                     finish_reason="length", prompt_tokens=1,
                                     completion_tokens=1)["system_fingerprint"] == "envloop-base"


def test_the_one_runner_serves_writes_its_port_and_stops_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    script = textwrap.dedent(f"""
        from dataclasses import dataclass
        from pathlib import Path
        from fastapi import FastAPI
        from envloop_pipelines.core.serve.server import serve_forever

        @dataclass
        class S:
            host: str = "127.0.0.1"
            port: int = 0
            port_file: Path = Path({str(port_file)!r})
            log_level: str = "warning"
            torch_threads: int | None = None
            graceful_shutdown_s: float = 1.0
            model_id: str = "tiny"

        def make():
            app = FastAPI()
            app.get("/health")(lambda: {{"status": "ok"}})
            return app

        serve_forever(make, S(), what="test")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the runner did not write its port"
            time.sleep(0.05)
        port = int(port_file.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
            assert response.status == 200
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- the prediction table


def test_the_baseline_writes_its_predictions_with_the_models_table() -> None:
    from envloop_pipelines.core.baseline import TfidfBaseline
    from envloop_pipelines.core.model.predict import PREDICTION_SCHEMA, predictions_from_table, predictions_table

    base = TfidfBaseline().fit(make_table(30, seed=0), make_table(10, seed=1, start=300))
    table = base.predict_table(make_table(10, seed=2, start=600))
    assert table.schema == PREDICTION_SCHEMA
    again = predictions_table(predictions_from_table(table))
    assert again.equals(table)
    assert not any(table.column("truncated").to_pylist()) and set(table.column("n_state_tokens_dropped").to_pylist()) == {0}
    assert np.allclose([sum(p) for p in table.column("probs").to_pylist()], 1.0)
