"""Environment datasets: content-addressed, versioned sets of environments under the EnvLoop home.

A dataset is a set of :class:`~.spec.EnvironmentSpec` stored once per content::

    <home>/environments/<name>/<version>/
        manifest.json          name, version, created_at, source (generator or import), counts, file hashes
        environments.jsonl     the agent view of each environment, one JSON object a line, sorted by id
        verifier/              owner-only (0700; files 0400): never in an attempt's reach
            verifier.jsonl     each environment's verifier spec and reference solution, same order

``version`` is the sha256 of the canonical JSON of the environments'
fingerprints (both sides of each spec) in id order, so the same environments
give the same version whatever their input order, and a change to any field
of any environment gives another. A version is immutable: storing the same
environments again returns the stored dataset and rewrites nothing (its
manifest keeps its first ``created_at`` and ``source``); the public files are
made read-only. Writes are staged beside the final folder and published with
one rename (:func:`~envloop_pipelines.core.storage.publish_dir`), so a reader
sees a whole version or none.

The ``environments`` folder is masked from every agent command
(:mod:`.terminal_episode`), and the ``verifier/`` part is owner-only besides, so the
fresh uid an agent's command runs as could not open it even unmasked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from envloop_pipelines.core.environments.spec import EnvironmentSpec, SpecError
from envloop_pipelines.core.storage import (
    atomic_write_bytes,
    canonical_json,
    envloop_home,
    publish_dir,
    read_jsonl,
    sha256_bytes,
    sha256_file,
    staging_dir,
)

log = logging.getLogger(__name__)

DATASETS_DIR = "environments"
MANIFEST_FILE = "manifest.json"
ENVIRONMENTS_FILE = "environments.jsonl"
VERIFIER_DIR = "verifier"
VERIFIER_FILE = "verifier.jsonl"
MANIFEST_FORMAT = 1
#: The verifier part is the owner's alone (as the label store of task snapshots).
VERIFIER_DIR_MODE = 0o700
VERIFIER_FILE_MODE = 0o400
PUBLIC_FILE_MODE = 0o444
#: A dataset name is one path segment: it names folders here and under agent_evals/.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_MANIFEST_FIELDS = ("format", "name", "version", "created_at", "source", "counts", "files")


def check_name(name: Any) -> str:
    """A dataset name: 1-100 letters, digits, '.', '_', '-', starting with a letter or digit."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or ".." in name:
        raise ValueError(f"dataset name must be 1-100 letters, digits, '.', '_' or '-' starting with a letter or "
                         f"digit (no '..'), got {name!r}")
    return name


def dataset_version(environments: Iterable[EnvironmentSpec]) -> str:
    """sha256 of the canonical JSON of the environments' fingerprints, in id order."""
    ordered = sorted(environments, key=lambda e: e.id)
    return sha256_bytes(canonical_json([e.fingerprint() for e in ordered]))


def counts_of(environments: Iterable[EnvironmentSpec]) -> dict[str, Any]:
    """Environments in all, by split, by kind and by verifier kind."""
    envs = list(environments)
    return {"environments": len(envs), "splits": _count(e.split for e in envs), "kinds": _count(e.kind for e in envs),
            "verifiers": _count(e.verifier.kind for e in envs)}


def _count(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class EnvironmentDataset:
    """A stored dataset version, its verifier side loaded.

    Attributes:
        name: the dataset's name.
        version: its content address (:func:`dataset_version`).
        environments: every environment, in id order, with its verifier and solution.
        manifest: the stored manifest (name, version, created_at, source, counts, files).
        path: the version's folder.
    """

    name: str
    version: str
    environments: tuple[EnvironmentSpec, ...]
    manifest: Mapping[str, Any]
    path: Path

    @property
    def ref(self) -> str:
        """``name@version``: what ``open_dataset``, ``envloop env eval --dataset`` and Dagster partitions take."""
        return f"{self.name}@{self.version}"

    def agent_views(self) -> list[dict[str, Any]]:
        """What agents may see of each environment (no verifier, no solution)."""
        return [e.agent_view() for e in self.environments]


def datasets_root(home: str | Path | None = None) -> Path:
    """``<home>/environments``: every dataset's folder (masked from agent commands)."""
    return envloop_home(home) / DATASETS_DIR


def _jsonl(rows: Iterable[Mapping[str, Any]]) -> bytes:
    return b"".join(canonical_json(dict(r)) + b"\n" for r in rows)


def store_dataset(name: str, environments: Iterable[EnvironmentSpec], *, source: Mapping[str, Any],
                  home: str | Path | None = None) -> EnvironmentDataset:
    """Store ``environments`` as a version of dataset ``name`` (or return the version already stored).

    Args:
        name: the dataset's name (:func:`check_name`).
        environments: the specs; ids must be unique. At least one.
        source: provenance for the manifest: ``{"generator": ..., <its parameters>}`` or
            ``{"import": "harbor", "path": ...}``; JSON values. Not part of the version.
        home: the EnvLoop home.

    Returns:
        The stored dataset, opened from disk.

    Raises:
        ValueError: a bad name, no environments, duplicate ids, or a source that is not a JSON object.
    """
    check_name(name)
    envs = sorted(environments, key=lambda e: e.id)
    if not envs:
        raise ValueError(f"dataset {name!r}: no environments to store")
    seen: set[str] = set()
    for e in envs:
        if not isinstance(e, EnvironmentSpec):
            raise ValueError(f"dataset {name!r}: {e!r} is not an EnvironmentSpec")
        if e.id in seen:
            raise ValueError(f"dataset {name!r}: environment id {e.id!r} appears twice")
        seen.add(e.id)
    if not isinstance(source, Mapping):
        raise ValueError(f"dataset {name!r}: source must be a JSON object, got {type(source).__name__}")
    json.dumps(dict(source))  # fail here, not halfway through the write, on a value that is not JSON
    version = dataset_version(envs)
    parent = datasets_root(home) / name
    final = parent / version
    if final.is_dir():
        return open_dataset(f"{name}@{version}", home=home)
    public = _jsonl(e.agent_view() for e in envs)
    hidden = _jsonl(e.verifier_view() for e in envs)
    staged = staging_dir(parent)
    try:
        (staged / VERIFIER_DIR).mkdir(mode=VERIFIER_DIR_MODE)
        os.chmod(staged / VERIFIER_DIR, VERIFIER_DIR_MODE)  # mkdir's mode is masked by the umask
        atomic_write_bytes(staged / ENVIRONMENTS_FILE, public)
        atomic_write_bytes(staged / VERIFIER_DIR / VERIFIER_FILE, hidden)
        manifest = {
            "format": MANIFEST_FORMAT, "name": name, "version": version, "created_at": time.time(),
            "source": dict(source), "counts": counts_of(envs),
            "files": {ENVIRONMENTS_FILE: sha256_bytes(public), f"{VERIFIER_DIR}/{VERIFIER_FILE}": sha256_bytes(hidden)},
        }
        atomic_write_bytes(staged / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
        for public_file in (MANIFEST_FILE, ENVIRONMENTS_FILE):
            os.chmod(staged / public_file, PUBLIC_FILE_MODE)
        os.chmod(staged / VERIFIER_DIR / VERIFIER_FILE, VERIFIER_FILE_MODE)
        os.chmod(staged, 0o755)  # mkdtemp made it 0700; the public part is readable like a task snapshot
    except BaseException:
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
        raise
    if publish_dir(staged, final):
        log.info("stored environment dataset %s@%s (%d environments)", name, version[:12], len(envs))
    return open_dataset(f"{name}@{version}", home=home)


def _versions(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".")) if parent.is_dir() else []


def resolve_version(name: str, version: str | None = None, *, home: str | Path | None = None) -> Path:
    """The folder of ``name@version``: the latest stored when ``version`` is None; a unique prefix is enough.

    Raises:
        FileNotFoundError: no such dataset or version (the message lists what is there).
        ValueError: a prefix that matches more than one version.
    """
    check_name(name)
    parent = datasets_root(home) / name
    versions = _versions(parent)
    if not versions:
        there = sorted(p.name for p in datasets_root(home).iterdir() if p.is_dir()) if datasets_root(home).is_dir() else []
        raise FileNotFoundError(f"no environment dataset {name!r} under {datasets_root(home)}"
                                + (f"; there are: {', '.join(there)}" if there else "; envloop env generate or import makes one"))
    if version is None:
        return max(versions, key=lambda p: (_created_at(p), p.name))
    hits = [p for p in versions if p.name.startswith(version)]
    if not hits:
        raise FileNotFoundError(f"dataset {name!r} has no version {version!r}; versions: "
                                + ", ".join(p.name[:12] for p in versions))
    if len(hits) > 1:
        raise ValueError(f"version prefix {version!r} of dataset {name!r} matches {len(hits)} versions: "
                         + ", ".join(p.name[:12] for p in hits))
    return hits[0]


def _created_at(folder: Path) -> float:
    try:
        value = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8")).get("created_at")
        return float(value)
    except (OSError, ValueError, TypeError, AttributeError):
        return folder.stat().st_mtime


def parse_ref(ref: str) -> tuple[str, str | None]:
    """``name[@version]`` as (name, version or None)."""
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"a dataset is named NAME or NAME@VERSION, got {ref!r}")
    name, _, version = ref.partition("@")
    return check_name(name), (version or None)


def read_manifest(folder: Path) -> dict[str, Any]:
    """A version's manifest, validated; every error names the file and the field.

    Raises:
        SpecError: a missing or malformed manifest.
    """
    path = folder / MANIFEST_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: missing (a dataset version has a manifest)") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: the manifest must be a JSON object, got {type(raw).__name__}")
    for key in _MANIFEST_FIELDS:
        if key not in raw:
            raise SpecError(f"{path}: field {key!r}: missing")
    if raw["format"] != MANIFEST_FORMAT:
        raise SpecError(f"{path}: field 'format': {raw['format']!r}, this version reads {MANIFEST_FORMAT}")
    if raw["name"] != folder.parent.name:
        raise SpecError(f"{path}: field 'name': {raw['name']!r}, but the folder is {folder.parent.name!r}")
    if raw["version"] != folder.name:
        raise SpecError(f"{path}: field 'version': {raw['version']!r}, but the folder is {folder.name!r}")
    if isinstance(raw["created_at"], bool) or not isinstance(raw["created_at"], (int, float)):
        raise SpecError(f"{path}: field 'created_at': must be a number (seconds since the epoch), got {raw['created_at']!r}")
    if not isinstance(raw["source"], dict):
        raise SpecError(f"{path}: field 'source': must be an object, got {type(raw['source']).__name__}")
    counts = raw["counts"]
    if not isinstance(counts, dict) or not isinstance(counts.get("environments"), int):
        raise SpecError(f"{path}: field 'counts.environments': must be an integer")
    files = raw["files"]
    wanted = {ENVIRONMENTS_FILE, f"{VERIFIER_DIR}/{VERIFIER_FILE}"}
    if not isinstance(files, dict) or set(files) != wanted or not all(isinstance(v, str) for v in files.values()):
        raise SpecError(f"{path}: field 'files': must map {', '.join(sorted(wanted))} to their sha256")
    return raw


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = read_jsonl(path, SpecError)
    for n, row in rows:
        if not isinstance(row, dict):
            raise SpecError(f"{path}:{n}: an environment must be a JSON object, got {type(row).__name__}")
    return rows


def open_dataset(ref: str, *, home: str | Path | None = None) -> EnvironmentDataset:
    """The stored dataset ``name[@version]`` (latest when no version; a unique version prefix is enough).

    The files are checked against the manifest's hashes and the version is recomputed from the
    environments, so a file edited on disk is an error, never a silently different dataset.

    Raises:
        FileNotFoundError: no such dataset or version.
        SpecError: a malformed manifest or environment, naming the file (and line) and the field.
        ValueError: an ambiguous version prefix.
    """
    name, version = parse_ref(ref)
    folder = resolve_version(name, version, home=home)
    manifest = read_manifest(folder)
    manifest_path = folder / MANIFEST_FILE
    public_path, hidden_path = folder / ENVIRONMENTS_FILE, folder / VERIFIER_DIR / VERIFIER_FILE
    for path, key in ((public_path, ENVIRONMENTS_FILE), (hidden_path, f"{VERIFIER_DIR}/{VERIFIER_FILE}")):
        if not path.is_file():
            raise SpecError(f"{path}: missing (named by {manifest_path} field 'files')")
        if sha256_file(path) != manifest["files"][key]:
            raise SpecError(f"{path}: sha256 differs from {manifest_path} field 'files.{key}' (edited on disk?)")
    public = _read_jsonl(public_path)
    hidden = {row.get("id"): (n, row) for n, row in _read_jsonl(hidden_path)}
    envs = []
    for n, row in public:
        where = f"{public_path}:{n}"
        if row.get("id") not in hidden:
            raise SpecError(f"{where}: field 'id': {row.get('id')!r} has no line in {hidden_path}")
        hn, hrow = hidden.pop(row["id"])
        extra = sorted(set(hrow) - {"id", "verifier", "solution"})
        if extra:
            raise SpecError(f"{hidden_path}:{hn}: field {extra[0]!r}: unknown; allowed: id, verifier, solution")
        try:
            envs.append(EnvironmentSpec.from_dict({**row, "verifier": hrow.get("verifier"),
                                                   "solution": hrow.get("solution")}, where))
        except SpecError as exc:  # the spec's own checks name the environment, not the file
            raise SpecError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None
    if hidden:
        raise SpecError(f"{hidden_path}: field 'id': {sorted(hidden)[0]!r} is not in {public_path}")
    if len(envs) != manifest["counts"]["environments"]:
        raise SpecError(f"{manifest_path}: field 'counts.environments': {manifest['counts']['environments']}, "
                        f"but {public_path} holds {len(envs)}")
    if dataset_version(envs) != folder.name:
        raise SpecError(f"{manifest_path}: field 'version': {folder.name} is not the hash of the stored environments "
                        f"({dataset_version(envs)})")
    return EnvironmentDataset(name=name, version=folder.name, environments=tuple(envs), manifest=manifest, path=folder)


def list_datasets(*, home: str | Path | None = None) -> list[dict[str, Any]]:
    """Every stored dataset version's manifest (with ``path``), by name, then oldest first.

    A version whose manifest cannot be read is listed with an ``error`` (the message naming the file and
    field) so that one broken folder does not hide the others.
    """
    root = datasets_root(home)
    out: list[dict[str, Any]] = []
    if not root.is_dir():
        return out
    for parent in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        rows = []
        for folder in _versions(parent):
            try:
                rows.append({**read_manifest(folder), "path": str(folder)})
            except SpecError as exc:
                rows.append({"name": parent.name, "version": folder.name, "created_at": folder.stat().st_mtime,
                             "path": str(folder), "error": str(exc)})
        out += sorted(rows, key=lambda m: (m["created_at"], m["version"]))
    return out


__all__ = [
    "DATASETS_DIR", "ENVIRONMENTS_FILE", "EnvironmentDataset", "MANIFEST_FILE", "VERIFIER_DIR",
    "VERIFIER_FILE", "check_name", "counts_of", "dataset_version", "datasets_root", "list_datasets", "open_dataset",
    "parse_ref", "read_manifest", "resolve_version", "store_dataset",
]
