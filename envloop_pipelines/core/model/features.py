"""Frozen lower layers, run once per distinct input: a content-addressed feature cache.

With ``frozen_layers: K`` a recipe trains only the encoder's top layers (LoRA
there) and the head; the embeddings and layers ``0 … K−1`` never change, so
their output for a given token sequence is a constant of the base model. It is
computed once per distinct sequence and kept:

* in memory, in an LRU bounded by bytes, shared by every model of the process
  on the same base weights (null arms, rounds, prediction);
* on disk, when a directory is given, as ``<root>/<namespace>/<xx>/<key>.npy``
  with ``<root>/<namespace>/manifest.json``. The namespace is the sha256 of the
  base model's weight file, its tokenizer file, ``K`` and :data:`FORMAT` — a changed
  model, tokenizer or layer count lands in another namespace and misses; the key
  is the sha256 of the token ids and segment ids (the text as the tokenizer read
  it). The directory is bounded by bytes; the oldest entries go first.

Exactness: the lower layers run on one sequence at a time, unpadded, in eval
mode and fp32, so a feature is the same bits whether it was computed now or
read from the cache (``np.save`` of float32 is lossless): predictions with and
without the cache are bit-identical.

Cost (the arithmetic behind the CPU recipe): a MiniLM layer at ~200 tokens is
~1/6 of a forward pass; training costs ~3 forward passes (forward + backward).
Full LoRA training over E epochs costs ``E·3·6`` layer-passes per question;
with ``K`` frozen it costs ``K`` once plus ``E·3·(6−K)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

#: Bump when the way features are computed changes (it is part of the namespace).
FORMAT = "lower-v1-fp32"
DEFAULT_MEMORY_BYTES = 4 << 30
DEFAULT_DISK_BYTES = 8 << 30
#: Writes between two checks of the directory's size.
BOUND_EVERY = 256


@lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file, memoised per (path, size, mtime)."""
    st = path.stat()
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns)


def base_identity(base_dir: Path) -> dict[str, str]:
    """What the lower layers' output depends on besides ``K``: the weight and tokenizer files' hashes."""
    weights = next((base_dir / n for n in ("model.safetensors", "pytorch_model.bin") if (base_dir / n).exists()), None)
    if weights is None:
        raise FileNotFoundError(f"{base_dir}: no model.safetensors or pytorch_model.bin to key the feature cache by")
    tokenizer = base_dir / "tokenizer.json"
    return {"weights_sha256": file_sha256(weights),
            "tokenizer_sha256": file_sha256(tokenizer) if tokenizer.exists() else "none"}


def namespace(identity: dict[str, str], frozen_layers: int) -> str:
    body = json.dumps({**identity, "frozen_layers": frozen_layers, "format": FORMAT}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def sequence_key(input_ids: Sequence[int], token_type_ids: Sequence[int]) -> str:
    """The content address of one input: its token ids and segment ids."""
    ids = np.asarray(input_ids, dtype=np.int32).tobytes()
    types = np.asarray(token_type_ids, dtype=np.int8).tobytes()
    return hashlib.sha256(len(ids).to_bytes(8, "little") + ids + types).hexdigest()


class FeatureCache:
    """Lower-layer features by content address: an in-memory LRU over an optional bounded directory."""

    def __init__(self, namespace: str, *, directory: Path | None = None, manifest: dict[str, Any] | None = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, disk_bytes: int = DEFAULT_DISK_BYTES) -> None:
        self.namespace = namespace
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes
        self._memory: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.disk_hits = 0
        self._puts = 0
        self.directory = directory / namespace if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / "manifest.json"
            if not path.exists():
                from envloop_pipelines.core.storage import atomic_write_json

                try:
                    atomic_write_json(path, {"namespace": namespace, **(manifest or {})})
                except FileExistsError:
                    pass  # another process wrote the same manifest first

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.npy"

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            found = self._memory.get(key)
            if found is not None:
                self._memory.move_to_end(key)
                self.hits += 1
                return found
        if self.directory is not None:
            path = self._path(key)
            if path.exists():
                try:
                    tensor = torch.from_numpy(np.load(path, allow_pickle=False))
                except (ValueError, OSError) as exc:  # a torn file from a killed writer: recompute it
                    log.warning("feature cache: unreadable %s (%s); recomputing", path, exc)
                    path.unlink(missing_ok=True)
                else:
                    self.disk_hits += 1
                    self._remember(key, tensor)
                    return tensor
        self.misses += 1
        return None

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self._remember(key, tensor)
        if self.directory is not None:
            path = self._path(key)
            if not path.exists():
                import io

                from envloop_pipelines.core.storage import atomic_write_bytes

                sink = io.BytesIO()
                np.save(sink, tensor.numpy(), allow_pickle=False)
                try:
                    atomic_write_bytes(path, sink.getvalue())
                except FileExistsError:
                    pass
                self._bound_disk()

    def _remember(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            if key in self._memory:
                return
            self._memory[key] = tensor
            self._held += size
            while self._held > self.memory_bytes and len(self._memory) > 1:
                _, old = self._memory.popitem(last=False)
                self._held -= old.numel() * old.element_size()

    def _bound_disk(self) -> None:
        self._puts += 1
        if self._puts % BOUND_EVERY == 0:
            self.prune()

    def prune(self) -> int:
        """Keep the directory under ``disk_bytes``, dropping the least recently written entries; the bytes kept."""
        if self.directory is None:
            return 0
        files = sorted(self.directory.glob("*/*.npy"), key=lambda p: p.stat().st_mtime_ns)
        total = sum(p.stat().st_size for p in files)
        while total > self.disk_bytes and files:
            victim = files.pop(0)
            total -= victim.stat().st_size
            victim.unlink(missing_ok=True)
        return total

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "disk_hits": self.disk_hits, "misses": self.misses, "entries": len(self._memory),
                "bytes_in_memory": self._held}


_CACHES: dict[tuple[str, str | None], FeatureCache] = {}


def default_directory() -> Path | None:
    """``$ENVLOOP_FEATURE_CACHE`` (``off`` disables the disk level), else ``<envloop home>/artifacts/features``."""
    value = os.environ.get("ENVLOOP_FEATURE_CACHE")
    if value == "off":
        return None
    if value:
        return Path(value)
    from envloop_pipelines.core.storage import envloop_home

    return envloop_home() / "artifacts" / "features"


def cache_for(base_dir: Path, frozen_layers: int, directory: Path | None = None) -> FeatureCache:
    """The process's cache of ``frozen_layers`` features of the base model in ``base_dir``."""
    identity = base_identity(base_dir)
    ns = namespace(identity, frozen_layers)
    directory = directory if directory is not None else default_directory()
    key = (ns, str(directory) if directory else None)
    if key not in _CACHES:
        _CACHES[key] = FeatureCache(ns, directory=directory,
                                    manifest={**identity, "frozen_layers": frozen_layers, "format": FORMAT})
    return _CACHES[key]


# --------------------------------------------------------------------------- running a BERT-class encoder in two parts


def _bert(encoder: nn.Module) -> nn.Module:
    base = encoder.get_base_model() if hasattr(encoder, "get_base_model") else encoder
    if not (hasattr(base, "embeddings") and hasattr(base, "encoder") and hasattr(base.encoder, "layer")):
        raise ValueError("frozen_layers needs a BERT-class encoder (embeddings + encoder.layer)")
    return base


def n_layers(encoder: nn.Module) -> int:
    return len(_bert(encoder).encoder.layer)


def _mask(base: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    mask, _ = base._create_attention_masks(attention_mask=attention_mask, encoder_attention_mask=None,
                                           embedding_output=hidden, encoder_hidden_states=None, cache=None)
    return mask


@torch.no_grad()
def run_lower(encoder: nn.Module, frozen_layers: int, input_ids: Sequence[int],
              token_type_ids: Sequence[int]) -> torch.Tensor:
    """Embeddings and layers ``0 … frozen_layers−1`` on one unpadded sequence, in eval mode: ``(seq, hidden)`` fp32."""
    base = _bert(encoder)
    modules = [base.embeddings, *base.encoder.layer[:frozen_layers]]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    # A normal tensor even when called under inference_mode (prediction): training may read it later; and
    # fp32 even under a bf16 autocast (FORMAT): a cached feature is the same bits whoever computed it.
    with torch.inference_mode(False), torch.autocast(device_type=hidden_device(encoder), enabled=False):
        return _lower(base, modules, modes, frozen_layers, input_ids, token_type_ids)


def hidden_device(encoder: nn.Module) -> str:
    """The device type (``cpu``, ``cuda``) the encoder's weights are on."""
    return next(encoder.parameters()).device.type


def _lower(base: nn.Module, modules: list, modes: list, frozen_layers: int, input_ids: Sequence[int],
           token_type_ids: Sequence[int]) -> torch.Tensor:
    try:
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        types = torch.tensor([list(token_type_ids)], dtype=torch.long)
        hidden = base.embeddings(input_ids=ids, token_type_ids=types)
        mask = _mask(base, hidden, torch.ones_like(ids))
        for layer in base.encoder.layer[:frozen_layers]:
            hidden = layer(hidden, mask)
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
    return hidden[0].float().contiguous()


def run_upper(encoder: nn.Module, frozen_layers: int, lower: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Layers ``frozen_layers …`` on padded lower features ``(batch, seq, hidden)``: the last hidden state."""
    base = _bert(encoder)
    mask = _mask(base, lower, attention_mask)
    hidden = lower
    for layer in base.encoder.layer[frozen_layers:]:
        hidden = layer(hidden, mask)
    return hidden


__all__ = ["FORMAT", "FeatureCache", "base_identity", "cache_for", "n_layers", "run_lower", "run_upper", "sequence_key"]
