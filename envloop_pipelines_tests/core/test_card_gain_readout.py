"""Issue 24: the release card says where the gain came from (by family, the round's clusters) and the head's share."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from envloop_pipelines.core.release.card import render_card
from envloop_pipelines.core.release.publish import readout_summary
from envloop_pipelines.core.model.lexical import head_share


def test_head_share_is_the_heads_part_of_the_fused_spread() -> None:
    head = [np.array([1.0, -1.0, 0.0]), np.array([2.0, 0.0])]
    lexical = [np.log(np.array([0.5, 0.25, 0.25])), np.log(np.array([0.9, 0.1]))]
    assert head_share(head, lexical, 0.0) == 1.0  # weight 0: the head alone
    assert head_share([np.zeros(3), np.full(2, 7.0)], lexical, 1.0) == 0.0  # constant logits: TF-IDF alone
    same = [np.log(np.array([0.5, 0.25, 0.25])) * 3.0]
    assert head_share(same, [np.log(np.array([0.5, 0.25, 0.25]))], 3.0) == pytest.approx(0.5)
    assert head_share([], [], 1.0) is None


def _checkpoint(tmp_path: Path, lexical: dict | None) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "metrics.json").write_text(json.dumps({"train": {"lexical": lexical}}))
    return ckpt


def test_readout_summary_reads_the_weight_and_share_from_the_checkpoint(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, {"weight": 0.5, "head_share": 0.31, "val_nll_by_weight": {"0": 1.02, "0.5": 0.93}})
    assert readout_summary(ckpt) == {"hybrid": True, "lexical_weight": 0.5, "head_share": 0.31,
                                     "val_nll_head_alone": 1.02, "val_nll": 0.93}
    (ckpt / "metrics.json").write_text(json.dumps({"train": {"lexical": None}}))
    assert readout_summary(ckpt) == {"hybrid": False, "head_share": 1.0}


def _card(**extra: object) -> dict:
    return {"release": 2, "task": "t", "round": "r0001", "parent_release": 1, "benchmark_version": "b",
            "data_snapshot": "d" * 16, "recipe_hash": "h" * 16, "checkpoint_sha256": "c" * 16, "holdout": {},
            "test": {"family_macro_accuracy": 0.6, "acc/route": 0.7, "acc/share_ok": 0.5},
            "parent_test": {"family_macro_accuracy": 0.55, "acc/route": 0.6, "acc/share_ok": 0.5},
            "tfidf_baseline_test": {"family_macro_accuracy": 0.52, "acc/route": 0.54, "acc/share_ok": 0.5}, **extra}


def test_the_card_shows_the_gain_by_family_the_clusters_and_the_heads_share() -> None:
    md = render_card(_card(change={"kind": "data", "clusters": ["route:level words"], "n_new_examples": 24},
                           readout={"hybrid": True, "lexical_weight": 0.5, "head_share": 0.31,
                                    "val_nll_head_alone": 1.02, "val_nll": 0.93}))
    assert "## Where the gain came from (test accuracy by family)" in md
    assert "| route | 0.7000 | 0.6000 | +0.1000 | 0.5400 |" in md
    assert "| share_ok | 0.5000 | 0.5000 | +0.0000 | 0.5000 |" in md
    assert "24 new examples aimed at the champion's failure clusters on dev: `route:level words`" in md
    assert "The head's share of the fused logits on val: 31%" in md and "0.5000 x TF-IDF + LR" in md
    # Release 1 (no parent) and a head-only checkpoint read plainly; an old card without these fields renders.
    first = render_card({**_card(readout={"hybrid": False, "head_share": 1.0}), "parent_test": None})
    assert "| route | 0.7000 | — | — | 0.5400 |" in first and "The encoder's head alone" in first
    assert "## Readout" not in render_card(_card())


def test_the_card_and_the_release_chain_say_what_the_release_answers_on_its_own(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: coverage at the error budget beside accuracy, in the card's header, the chain's table and the
    line before the champion's holdout line (the key's budget read, not assumed)."""
    from envloop_pipelines.cli.render import echo_releases
    from envloop_pipelines.core.release.card import answers_on_its_own, coverage_of

    card = _card(test={"family_macro_accuracy": 0.6, "coverage_at_5pct": 0.025},
                 tfidf_baseline_test={"family_macro_accuracy": 0.52, "coverage_at_5pct": 0.0})
    assert coverage_of(card["test"]) == (0.05, 0.025)
    assert coverage_of({"coverage_at_2.5pct": 0.4}) == (0.025, 0.4)
    assert coverage_of({"family_macro_accuracy": 0.6}) == (None, None) == coverage_of(None)
    line = answers_on_its_own(card)
    assert line == ("release 2 answers 2.5% of the test questions on its own within a 5% error budget "
                    "(family-macro accuracy 0.6000 on all of them); a person gets the other 97.5%")
    assert f"- on its own: {line} (coverage at the error budget, test)" in render_card(card)
    assert answers_on_its_own(_card()) is None and "on its own" not in render_card(_card())  # an old card
    echo_releases("t", [card])
    header, row = capsys.readouterr().out.splitlines()[1:3]
    assert "test cov@5%" in header and row.split()[8:10] == ["0.0250", "0.0000"], (header, row)
