"""Checkpoints: one directory per trained model, verified before use.

Layout::

    <ckpt>/
      adapter/             peft ``save_pretrained`` of the LoRA on the base model (adapter_config.json
                           naming the base model by the recipe's spec; no model card)
      head.safetensors     the readout's own tensors (decision head weights; label token ids)
      calibration.json     per-type temperatures and the automation threshold (fitted on val)
      recipe.yaml          the recipe it was trained with
      data.json            the data snapshot hash(es) given by the caller
      metrics.json         training and validation metrics
      provenance.json      package versions, git commit + dirty flag, recipe hash, data hash, base model sha256
      predictions.parquet  end-of-training predictions on the eval split
      lexical.json         hybrid readout only (recipe key ``lexical``): the per-family TF-IDF vocabularies,
      lexical.safetensors  classes and fusion weight (JSON), idf and classifier weights (arrays)
      manifest.json        sha256 of every file above

What goes into the files above the manifest is one value, :class:`CheckpointParts` (one field
per part); :func:`write_checkpoint` writes it and adds the manifest.

A checkpoint is written to a temporary sibling directory and renamed into
place, so a reader never sees half of one; an existing directory is never
overwritten. :func:`load_checkpoint` verifies the manifest first (and the base
model's sha256 against the provenance) and raises
:class:`CheckpointIntegrityError` naming the file at fault.

Identity (:func:`checkpoint_hash`): the sha256 of the manifest entries of
every file **except** ``metrics.json`` and ``provenance.json``, which carry
timings and timestamps. Those two are still covered by the manifest's
integrity check, but leaving them out of the identity makes it a function of
what decides the predictions (adapter, head, calibration, recipe, data hash,
predictions): a deterministic retrain gives the same identity, so checkpoints
can be stored under it.

The identity does not depend on where the base model is installed. peft
writes the base model's absolute path (inside the venv's site-packages for the
packaged MiniLM) into ``adapter_config.json`` and into a ``README.md`` model
card; the writer replaces the first with the recipe's ``base_model`` spec and
drops the second (nothing loads it), and loading resolves the spec in the
recipe to a directory, as it always has. A checkpoint written before keeps its
manifest, identity and path-bearing files, and loads and verifies as before:
its adapter's ``base_model_name_or_path`` was never read to find the base.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.model.calibration import Calibration
from envloop_pipelines.core.model.lexical import LEXICAL_JSON, LexicalModel
from envloop_pipelines.core.model.readout import ReadoutModel
from envloop_pipelines.core.model.readouts import build_readout_model
from envloop_pipelines.core.model.recipe import Recipe, dump_recipe, recipe_from_dict, recipe_hash, resolve_base_model

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "envloop-checkpoint/1"
ADAPTER_DIR = "adapter"
HEAD_FILE = "head.safetensors"
CALIBRATION_FILE = "calibration.json"
RECIPE_FILE = "recipe.yaml"
DATA_FILE = "data.json"
METRICS_FILE = "metrics.json"
PROVENANCE_FILE = "provenance.json"
PREDICTIONS_FILE = "predictions.parquet"
_CHUNK = 1 << 20


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint file is missing, extra, or differs from its manifest (or the base model changed).

    Attributes:
        checkpoint: The checkpoint directory.
        file: The file at fault, relative to the checkpoint (``"<base model>"`` for the base weights).
    """

    def __init__(self, checkpoint: Path, file: str, reason: str) -> None:
        self.checkpoint = Path(checkpoint)
        self.file = file
        super().__init__(f"checkpoint {checkpoint}: {file}: {reason}")


# --------------------------------------------------------------------------- hashing


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=16)
def _cached_sha(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def model_weights_sha256(model_dir: str | Path) -> dict[str, str]:
    """sha256 of each weight file (``*.safetensors``, else ``*.bin``) of a model directory, by name.

    Cached by (path, size, mtime) so a process that loads the same base model
    many times hashes it once.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin weight file in {model_dir}")
    out = {}
    for f in files:
        st = f.stat()
        out[f.name] = _cached_sha(str(f.resolve()), st.st_size, st.st_mtime_ns)
    return out


def combined_sha256(hashes: Mapping[str, str]) -> str:
    """One hash for several files: the sha256 of ``name:sha\\n`` lines in name order (the file's own when only one)."""
    if len(hashes) == 1:
        return next(iter(hashes.values()))
    lines = "".join(f"{name}:{hashes[name]}\n" for name in sorted(hashes))
    return hashlib.sha256(lines.encode()).hexdigest()


#: peft's adapter files, inside ``adapter/``.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MODEL_CARD = "README.md"

#: Files whose bytes change from run to run (timings, timestamps): in the manifest, not in the identity.
VOLATILE_FILES: frozenset[str] = frozenset({METRICS_FILE, PROVENANCE_FILE})


def identity_of(files: Mapping[str, str]) -> str:
    """sha256 of the canonical JSON of ``{path: sha256}`` over the non-volatile files."""
    stable = {k: v for k, v in files.items() if k not in VOLATILE_FILES}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoint_hash(ckpt_dir: str | Path) -> str:
    """The checkpoint's identity (see the module docstring), read from its manifest (not verified here)."""
    manifest = json.loads((Path(ckpt_dir) / MANIFEST).read_text(encoding="utf-8"))
    return identity_of(manifest["files"])


# --------------------------------------------------------------------------- provenance


def git_state(path: str | Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the git work tree holding ``path`` (this package by default); nulls outside git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=False
        )
        status = subprocess.run(
            # --no-optional-locks: read only, never refresh the index (another git may be running).
            ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd=where, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    sha = commit.stdout.strip() if commit.returncode == 0 else None
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return {"git_commit": sha, "git_dirty": dirty}


def package_versions() -> dict[str, str | None]:
    """Versions of the packages a checkpoint's numbers depend on."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "numpy", "safetensors", "tokenizers", "deepspeed"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def build_provenance(
    recipe: Recipe, data_hash: str, *, init_from_hash: str | None = None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Provenance of a training run: versions, git, recipe hash, data hash, base model sha256."""
    import torch

    base_dir = resolve_base_model(recipe)
    weights = model_weights_sha256(base_dir)
    return {
        "versions": package_versions(),
        **git_state(),
        "platform": platform.platform(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_num_threads": torch.get_num_threads(),
        "recipe_hash": recipe_hash(recipe),
        "data_hash": data_hash,
        "base_model": recipe.base_model,
        "base_model_sha256": combined_sha256(weights),
        "base_model_files": weights,
        "init_from": init_from_hash,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        **dict(extra or {}),
    }


# --------------------------------------------------------------------------- writing


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


def _manifest_of(root: Path) -> dict[str, str]:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            if rel != MANIFEST:
                files[rel] = sha256_file(p)
    return files


def save_adapter(model: ReadoutModel, recipe: Recipe, adapter_dir: str | Path) -> Path:
    """peft ``save_pretrained`` of the model's LoRA, with nothing in it that names where the base model is installed.

    peft writes the base model's absolute path twice: ``base_model_name_or_path``
    in ``adapter_config.json``, and a ``README.md`` model card. Both would make the
    checkpoint's identity a function of the venv's location. The config gets the
    recipe's ``base_model`` spec (``packaged:minilm``) instead; the model card,
    which nothing loads, is not kept.

    Returns:
        The adapter directory.
    """
    adapter_dir = Path(adapter_dir)
    model.encoder.save_pretrained(str(adapter_dir))  # type: ignore[operator]
    (adapter_dir / ADAPTER_MODEL_CARD).unlink(missing_ok=True)
    config_path = adapter_dir / ADAPTER_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = recipe.base_model
    # peft's own layout (indent 2, sorted keys), so the file differs from peft's in the spec and the order below.
    config_path.write_text(json.dumps(stable_adapter_config(config), indent=2, sort_keys=True), encoding="utf-8")
    return adapter_dir


def stable_adapter_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``adapter_config.json``'s fields with peft's sets written sorted, so one training gives one file.

    peft keeps ``target_modules`` (and ``modules_to_save`` where a set) as Python sets and writes them in
    set order, which follows the process's string hash seed (``PYTHONHASHSEED``): the same recipe on the
    same data gave another checkpoint hash in another process. peft reads the list back into a set, so
    the order carries nothing.
    """
    out = dict(config)
    for name in ("target_modules", "modules_to_save"):
        if isinstance(out.get(name), list) and all(isinstance(v, str) for v in out[name]):
            out[name] = sorted(out[name])
    return out


@dataclass(frozen=True)
class CheckpointParts:
    """The parts of a checkpoint, one field each, as :func:`write_checkpoint` writes them (the layout above).

    Attributes:
        model: The trained readout: its LoRA to ``adapter/`` (:func:`save_adapter`), its own tensors to
            :data:`HEAD_FILE`.
        recipe: To :data:`RECIPE_FILE`.
        calibration: To :data:`CALIBRATION_FILE`.
        data: To :data:`DATA_FILE`: the data snapshot hash(es) given by the caller.
        metrics: To :data:`METRICS_FILE` (JSON: no NaN).
        provenance: To :data:`PROVENANCE_FILE`.
        predictions: To :data:`PREDICTIONS_FILE`.
        lexical: The hybrid readout's lexical part, to ``lexical.json`` and ``lexical.safetensors``; None
            without one (no file).
    """

    model: ReadoutModel
    recipe: Recipe
    calibration: Calibration
    data: Mapping[str, Any]
    metrics: Mapping[str, Any]
    provenance: Mapping[str, Any]
    predictions: pa.Table
    lexical: LexicalModel | None = None


def _write_parts(root: Path, parts: CheckpointParts) -> None:
    """Each part of ``parts`` to its file(s) under ``root``."""
    from safetensors.torch import save_file

    save_adapter(parts.model, parts.recipe, root / ADAPTER_DIR)
    save_file(parts.model.head_state_dict(), str(root / HEAD_FILE), metadata={"readout": parts.recipe.readout})
    (root / CALIBRATION_FILE).write_bytes(_json_bytes(parts.calibration.to_dict()))
    (root / RECIPE_FILE).write_text(dump_recipe(parts.recipe), encoding="utf-8")
    (root / DATA_FILE).write_bytes(_json_bytes(dict(parts.data)))
    (root / METRICS_FILE).write_bytes(_json_bytes(dict(parts.metrics)))
    (root / PROVENANCE_FILE).write_bytes(_json_bytes(dict(parts.provenance)))
    pq.write_table(parts.predictions, root / PREDICTIONS_FILE)
    if parts.lexical is not None:
        parts.lexical.save(root)


def write_checkpoint(out_dir: str | Path, parts: CheckpointParts) -> Path:
    """Write a checkpoint directory atomically (temp sibling + rename); never overwrite.

    Args:
        out_dir: The checkpoint directory to create.
        parts: What goes into it; the manifest is added.

    Raises:
        FileExistsError: when ``out_dir`` exists (checked before and right before the rename).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"checkpoint directory {out_dir} already exists; checkpoints are never overwritten")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _write_parts(tmp, parts)
        files = _manifest_of(tmp)
        manifest = {"format": FORMAT, "checkpoint_hash": identity_of(files), "files": files}
        (tmp / MANIFEST).write_bytes(_json_bytes(manifest))
        if out_dir.exists():
            raise FileExistsError(f"checkpoint directory {out_dir} appeared while writing; checkpoints are never overwritten")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("checkpoint written: %s (checkpoint hash %s)", out_dir, manifest["checkpoint_hash"])
    return out_dir


# --------------------------------------------------------------------------- reading


def verify_checkpoint(ckpt_dir: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; return the manifest.

    Raises:
        CheckpointIntegrityError: naming the missing, extra or modified file.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointIntegrityError(root, ".", "not a checkpoint directory (does not exist)")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointIntegrityError(root, MANIFEST, "missing: not a checkpoint, or an unfinished one")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        listed: dict[str, str] = dict(manifest["files"])
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointIntegrityError(root, MANIFEST, f"unreadable: {exc}") from None
    if manifest.get("checkpoint_hash") != identity_of(listed):
        raise CheckpointIntegrityError(root, MANIFEST, "its checkpoint_hash does not match its file list (edited after writing)")
    for rel in sorted(listed):
        path = root / rel
        if not path.is_file():
            raise CheckpointIntegrityError(root, rel, "missing (listed in the manifest)")
        actual = sha256_file(path)
        if actual != listed[rel]:
            raise CheckpointIntegrityError(
                root, rel, f"sha256 {actual[:16]}… differs from the manifest's {listed[rel][:16]}… (modified after writing)"
            )
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {MANIFEST}
    extra = sorted(present - set(listed))
    if extra:
        raise CheckpointIntegrityError(root, extra[0], f"not in the manifest (extra file{'s' if len(extra) > 1 else ''}: {extra!r})")
    for required in (HEAD_FILE, CALIBRATION_FILE, RECIPE_FILE, PROVENANCE_FILE, f"{ADAPTER_DIR}/{ADAPTER_CONFIG}"):
        if required not in listed:
            raise CheckpointIntegrityError(root, required, "missing from the manifest: incomplete checkpoint")
    return manifest


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint with its model built."""

    path: Path
    recipe: Recipe
    calibration: Calibration
    model: ReadoutModel
    metrics: dict[str, Any]
    provenance: dict[str, Any]
    data: dict[str, Any]
    checkpoint_hash: str
    lexical: LexicalModel | None = None


def read_recipe(ckpt_dir: str | Path) -> Recipe:
    """The recipe stored in a checkpoint (no verification)."""
    import yaml

    return recipe_from_dict(yaml.safe_load((Path(ckpt_dir) / RECIPE_FILE).read_text(encoding="utf-8")))


def read_predictions(ckpt_dir: str | Path) -> pa.Table:
    """The end-of-training predictions stored in a checkpoint (no verification)."""
    return pq.read_table(Path(ckpt_dir) / PREDICTIONS_FILE)


def load_checkpoint(ckpt_dir: str | Path, *, trainable: bool = False, verify_base_model: bool = True) -> LoadedCheckpoint:
    """Verify a checkpoint and build its model (eval mode unless ``trainable``).

    Args:
        ckpt_dir: The checkpoint directory.
        trainable: Load the adapter and head as trainable (to continue training).
        verify_base_model: Check the base model's weights against the sha256 in the provenance.

    Raises:
        CheckpointIntegrityError: a file differs from the manifest, or the base model changed.
    """
    from safetensors.torch import load_file

    root = Path(ckpt_dir)
    manifest = verify_checkpoint(root)
    recipe = read_recipe(root)
    provenance = json.loads((root / PROVENANCE_FILE).read_text(encoding="utf-8"))
    if verify_base_model:
        actual = combined_sha256(model_weights_sha256(resolve_base_model(recipe)))
        expected = provenance.get("base_model_sha256")
        if actual != expected:
            raise CheckpointIntegrityError(
                root, "<base model>",
                f"{recipe.base_model!r} weights have sha256 {actual[:16]}…, the checkpoint was trained on {str(expected)[:16]}…",
            )
    calibration = Calibration.from_dict(json.loads((root / CALIBRATION_FILE).read_text(encoding="utf-8")))
    model = build_readout_model(
        recipe, adapter_dir=root / ADAPTER_DIR, head_state=load_file(str(root / HEAD_FILE)), trainable=trainable
    )
    if recipe.lexical and LEXICAL_JSON not in manifest["files"]:
        raise CheckpointIntegrityError(root, LEXICAL_JSON, "missing: the recipe has a lexical readout")
    lexical = LexicalModel.load(root) if recipe.lexical else None

    def _read(name: str) -> dict[str, Any]:
        p = root / name
        return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
    return LoadedCheckpoint(
        path=root,
        recipe=recipe,
        calibration=calibration,
        model=model,
        metrics=_read(METRICS_FILE),
        provenance=provenance,
        data=_read(DATA_FILE),
        checkpoint_hash=checkpoint_hash(root),
        lexical=lexical,
    )


__all__ = [
    "CheckpointIntegrityError",
    "CheckpointParts",
    "LoadedCheckpoint",
    "VOLATILE_FILES",
    "build_provenance",
    "checkpoint_hash",
    "load_checkpoint",
    "model_weights_sha256",
    "read_predictions",
    "read_recipe",
    "save_adapter",
    "sha256_file",
    "stable_adapter_config",
    "verify_checkpoint",
    "write_checkpoint",
]
