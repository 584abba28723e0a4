"""Predictions reused by (checkpoint identity, inputs): hits, misses on any change, identical tables."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.model import predict
from envloop_pipelines.core.model.checkpoint import CheckpointIntegrityError, HEAD_FILE
from envloop_pipelines.core.model.predict import DecisionModel, predict_table, prediction_cache_key
from envloop_pipelines.core.model.recipe import Recipe
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table

limit_threads_under_xdist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    train, val = questions_table(make_records(16)), make_table(8, seed=1, start=500)
    recipe = Recipe(max_length=128, max_steps=2, batch_size=8, eval_batch_size=16)
    a = train_checkpoint(train, val, recipe, root / "a", data_hash="snap-1")
    b = train_checkpoint(train, val, recipe.replace(seed=1), root / "b", data_hash="snap-1")
    return a, b


def test_reused_predictions_are_the_computed_ones_and_any_change_misses(checkpoints: tuple[Path, Path], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = checkpoints
    table = make_table(10, seed=2, start=900)
    cache = tmp_path / "predictions"
    first = predict_table(a, table, cache_dir=cache)
    assert first.equals(predict_table(a, table))  # the cache changes nothing
    assert len(list(cache.glob("*.parquet"))) == 1

    loads: list[str] = []
    real_load = DecisionModel.load.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(DecisionModel, "load", classmethod(lambda cls, path, **kw: loads.append(str(path)) or real_load(cls, path, **kw)))
    again = predict_table(a, table, cache_dir=cache)
    assert again.equals(first) and loads == []  # a hit: no model built

    predict_table(b, table, cache_dir=cache)  # another checkpoint misses
    changed = table.set_column(table.column_names.index("state_text"), "state_text",
                               pa.array([s + " (edited)" for s in table.column("state_text").to_pylist()]))
    predict_table(a, changed, cache_dir=cache)  # another input misses
    assert loads == [str(b), str(a)] and len(list(cache.glob("*.parquet"))) == 3
    # Labels are not inputs: the same questions with labels hit the same entry.
    assert prediction_cache_key(a, table.drop_columns(["label"]) if "label" in table.column_names else table) \
        == prediction_cache_key(a, table)
    monkeypatch.setattr(predict, "PREDICTION_CODE_VERSION", "changed")
    assert prediction_cache_key(a, table) != prediction_cache_key(b, table)
    predict_table(a, table, cache_dir=cache)
    assert len(loads) == 3  # new prediction code misses


def test_a_modified_checkpoint_is_refused_before_the_cache_is_read(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = checkpoints
    table = make_table(4, seed=3, start=950)
    predict_table(a, table, cache_dir=tmp_path)
    head = a / HEAD_FILE
    saved = head.read_bytes()
    try:
        head.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
        with pytest.raises(CheckpointIntegrityError, match=HEAD_FILE):
            predict_table(a, table, cache_dir=tmp_path)
    finally:
        head.write_bytes(saved)
