"""Releases: the one holdout read, the registered model version, the champion alias and the card.

:func:`release_checkpoint` is the only way a checkpoint becomes a release, in either loop: the
release number, the one holdout read (through the read the caller gives), the release's MLflow
run with its metrics and the checkpoint as its artifact, the registered model version, the
champion alias and the card. The decision loop calls it through :func:`publish_release` (the
bootstrap champion, the control arm of the noise floor, and every promotion; the holdout read
through the verifier); the RL loop's promotion calls it with its held-out pass@1 read
(``core/rl_loop/run_round.py``). It reaches MLflow only through the ``Tracker`` protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envloop_pipelines.core.data.snapshots import TaskSnapshot
from envloop_pipelines.core.release.card import render_card
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.ledger.anchor import anchor_head
from envloop_pipelines.core.ledger.event_log import LedgerError
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.release.tracked_runs import child_run, flat_metrics, verify_predictions, write_predictions
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.storage import atomic_write_parquet
from envloop_pipelines.core.tracking import (
    HOLDOUT_PREFIX,
    KIND_RELEASE,
    TAG_CHECKPOINT,
    TAG_KIND,
    TAG_RELEASE,
    TAG_ROUND,
    Tracker,
)


@dataclass(frozen=True)
class Release:
    """A published release: its number, registered model version and card."""

    release: int
    model_version: str
    card: Mapping[str, Any]


def champion(config: LoopConfig) -> dict[str, Any]:
    """The latest release card (the champion).

    Raises:
        LedgerError: the task has no release yet (the noise floor step makes release 1).
    """
    releases = Ledger(config.task, config.home).releases()
    if not releases:
        raise LedgerError(f"task {config.task!r} has no champion yet: materialize noise_floor first")
    return releases[-1]


@dataclass(frozen=True)
class HoldoutRead:
    """What a release's one holdout read gives: the card's ``holdout`` (``metrics``, its numbers logged on the
    release's run as ``holdout.<name>``) and, from the decision loop's verifier run, TF-IDF + LR's metrics beside
    them (``holdout.tfidf.<name>``; the card's ``holdout_tfidf``) and the paired deltas release − TF-IDF
    (record-clustered bootstrap, 95%; the card's ``holdout_vs_tfidf``). A read without the classical
    baseline (the RL loop's) leaves both ``None`` and the card without them."""

    metrics: Mapping[str, Any]
    tfidf: Mapping[str, Any] | None = None
    vs_tfidf: Mapping[str, Any] | None = None


def tfidf_baseline(config: LoopConfig, snapshot: TaskSnapshot, train: Any = None) -> Any:
    """TF-IDF + LR calibrated on val (safety thresholds included): the classical model a user would build
    from the same data, printed beside every release. ``train``: the rows the release trained on (a round's
    snapshot, synthesized rows included), default the task's train split."""
    from envloop_pipelines.core.baseline import TfidfBaseline

    rows = snapshot.table("train") if train is None else train
    return TfidfBaseline(safety_families=config.safety_families,
                         safety_fnr_target=config.safety_fnr_target).fit(rows, snapshot.table("val"))


def holdout_metrics(config: LoopConfig, checkpoint: Path, snapshot: TaskSnapshot, out: Path, *, ledger: Ledger,
                    release: int, tfidf: Any = None, sandbox: SandboxSettings | None = None) -> HoldoutRead:
    """The checkpoint's holdout metrics from the verifier, as the release's one holdout read.

    It opens the release's holdout slot for these predictions (:func:`~envloop_pipelines.core.ledger.reads.open_holdout_slot`) and the
    verifier takes it (``Ledger.read_holdout_once``) around the run, so this is the read, and a second
    one for the release (or any read of other predictions) is refused. TF-IDF + LR's predictions
    are scored in the same run as its baseline, so the classical figure costs no second read. ``tfidf``:
    the fitted baseline whose test column the card shows (default: :func:`tfidf_baseline` on train).
    ``sandbox``: the deployment's sandbox, where the verifier runs (default: the local backend).

    A retry after a crash between this read and the card finishes from the stored read (no second read).

    Raises:
        HoldoutAlreadyReadError: the release already read the holdout.
    """
    holdout = snapshot.table("holdout")
    tfidf = tfidf if tfidf is not None else tfidf_baseline(config, snapshot)
    tfidf_out = out.with_name(f"{out.stem}-tfidf.parquet")
    if ledger.holdout_result(release) is not None and out.exists() and tfidf_out.exists():
        # A retry after a crash between the read and the card: the files the stored read scored, byte for byte,
        # so the verifier gives that read back instead of refusing a second one.
        preds, tfidf_preds = out, tfidf_out
    else:
        preds = write_predictions(out, checkpoint, holdout)
        tfidf_preds = atomic_write_parquet(tfidf_out, tfidf.predict_table(holdout), overwrite=True)
    from envloop_pipelines.core.ledger.reads import holdout_read_key, open_holdout_slot

    if ledger.holdout_result(release) is None:  # the slot is for this checkpoint's predictions and nothing else
        open_holdout_slot(ledger, release, holdout_read_key(preds, tfidf_preds), by=f"release step: {checkpoint.name}")
    run = verify_predictions(config, "holdout", preds, baseline=tfidf_preds, holdout_slot=ledger, release=release,
                             checkpoint=checkpoint, baseline_safety_thresholds=tfidf.calibration.safety_thresholds,
                             sandbox=sandbox)
    return HoldoutRead(metrics=dict(run.report.metrics), tfidf=dict(run.baseline_report.metrics),
                       vs_tfidf=dict((run.paired or {}).get("deltas") or {}))


def release_checkpoint(config: LoopConfig, tracker: Tracker, *, checkpoint: Path,
                       read_holdout: Callable[[Ledger, int], HoldoutRead],
                       card: Callable[[int, HoldoutRead], dict[str, Any]],
                       render: Callable[[Mapping[str, Any]], str] = render_card,
                       round_key: str | None = None, run_tags: Mapping[str, str] | None = None) -> Release:
    """Make ``checkpoint`` the task's next release: read the holdout once, register it, move the alias, write the card.

    In order: the release number (:meth:`Ledger.next_release_number`); ``read_holdout(ledger, release)``,
    the release's one holdout read (the caller's read goes through :meth:`Ledger.read_holdout_once`, so a
    second read is refused and a retry after a crash finishes from the stored read); the release's MLflow
    run (a child of the round's run, or a bootstrap run) with the read's metrics and the checkpoint as its
    ``checkpoint`` artifact; a version of ``config.model_name`` registered from that artifact, and the
    champion alias moved to it; the card, written once by the ledger.

    A round publishes one release: when ``round_key`` already has a card (a crash came between the card and
    the round's ``round_decided``), its release is returned and nothing is read, logged or registered again
    (on a checkpoint other than the card's, :class:`LedgerError`). A crash before the card leaves no card: the
    retry finishes from the stored read in the release run the crashed attempt started, whose checkpoint is
    registered once, so the registry keeps one version of the release.

    Args:
        config: the loop (its task, home and registered model name).
        tracker: MLflow (through the ``Tracker`` protocol).
        checkpoint: the checkpoint directory to release (named by its content hash).
        read_holdout: the release's one holdout read, given the ledger and the release number.
        card: builds the card's body from ``(release number, the read)``; the release number, the read
            (``holdout``, and ``holdout_tfidf`` / ``holdout_vs_tfidf`` when it has a baseline), the model
            version and the MLflow run are added here.
        render: the card's Markdown from its body (default: the decision loop's :func:`render_card`).
        round_key: the round that promoted the checkpoint (its release run is a child of the round's
            run); ``None`` for the bootstrap release.
        run_tags: extra tags of the release run (the Dagster run).
    """
    ledger = Ledger(config.task, config.home)
    published = None if round_key is None else ledger.release_of_round(round_key)
    if published is not None:
        # A retry after a crash between the card and the round's decision: the round's release exists (its read,
        # run, version, alias and card); publishing again would make the same checkpoint the next release.
        released = published.get("checkpoint_dir") or published.get("policy_checkpoint")
        if released is not None and Path(released).name != checkpoint.name:
            raise LedgerError(f"round {round_key} published release {published['release']} of checkpoint {released}, "
                              f"not {checkpoint}; a round publishes one release")
        ledger.record_release_promoted(int(published["release"]), published)  # a crash may have come before it
        return Release(release=int(published["release"]), model_version=str(published["model_version"]),
                       card=published)
    release = ledger.next_release_number()
    read = read_holdout(ledger, release)
    holdout = dict(read.metrics)
    tags = {TAG_RELEASE: str(release), TAG_CHECKPOINT: checkpoint.name,
            **({} if round_key is None else {TAG_ROUND: round_key})}
    # A retry after a crash between the release's run and its card carries on in that run (its version is
    # registered once), so the registry holds one version of the release.
    mrun = tracker.find_run(config.task, {TAG_KIND: KIND_RELEASE, **tags})
    if mrun is None and round_key is not None:
        mrun = child_run(tracker, config, round_key, KIND_RELEASE, {**(run_tags or {}), **tags})
    elif mrun is None:
        mrun = tracker.start_run(config.task, f"release {release} (bootstrap)",
                                 tags={TAG_KIND: KIND_RELEASE, **(run_tags or {}), **tags})
    metrics = flat_metrics(holdout, HOLDOUT_PREFIX)
    if read.tfidf is not None:
        metrics.update(flat_metrics(read.tfidf, f"{HOLDOUT_PREFIX}tfidf."))
    tracker.log_metrics(mrun.run_id, metrics)
    tracker.log_artifact(mrun.run_id, checkpoint, "checkpoint")
    version = tracker.register_version(config.model_name, f"{tracker.artifact_uri(mrun.run_id)}/checkpoint",
                                       mrun.run_id, tags=tags)
    tracker.set_champion(config.model_name, version)
    tracker.end_run(mrun.run_id)
    baseline = {} if read.tfidf is None else {"holdout_tfidf": dict(read.tfidf),
                                              "holdout_vs_tfidf": dict(read.vs_tfidf or {})}
    body = {**card(release, read), "release": release, "holdout": holdout, **baseline, "model_version": version,
            "mlflow_run_id": mrun.run_id}
    ledger.write_release_card(release, body, render(body))
    anchor_head(ledger, tracker)  # the release's read and card, anchored in MLflow (issue 34)
    return Release(release=release, model_version=version, card=body)


def publish_release(config: LoopConfig, tracker: Tracker, *, checkpoint: Path, snapshot: TaskSnapshot,
                    holdout_out: Path, card: Callable[[int, dict[str, Any]], dict[str, Any]],
                    round_key: str | None = None, run_tags: Mapping[str, str] | None = None,
                    tfidf: Any = None, sandbox: SandboxSettings | None = None) -> Release:
    """The decision loop's release: :func:`release_checkpoint` with the holdout read through the verifier
    (:func:`holdout_metrics`, TF-IDF + LR scored in the same read) and the card rendered by :func:`render_card`.

    Args:
        config: the loop.
        tracker: MLflow (through the ``Tracker`` protocol).
        checkpoint: the checkpoint directory to release (named by its content hash).
        snapshot: the task snapshot whose holdout is read.
        holdout_out: where the holdout predictions are written.
        card: builds the card's body from ``(release number, holdout metrics)``; the checkpoint's inference
            precision and readout are added here, the model version and the MLflow run by
            :func:`release_checkpoint`.
        tfidf: the fitted TF-IDF + LR whose holdout column the card shows (default: fitted on the task's train split).
        round_key: the round that promoted the checkpoint (its release run is a child of the round's
            run); ``None`` for the bootstrap release.
        run_tags: extra tags of the release run (the Dagster run).
        sandbox: the deployment's sandbox, where the verifier reads the holdout (default: the local backend).
    """
    from envloop_pipelines.core.model.checkpoint import read_recipe

    def read(ledger: Ledger, release: int) -> HoldoutRead:
        return holdout_metrics(config, checkpoint, snapshot, holdout_out, ledger=ledger, release=release,
                               tfidf=tfidf, sandbox=sandbox)

    def body(release: int, holdout: HoldoutRead) -> dict[str, Any]:
        return {**card(release, dict(holdout.metrics)),
                "inference_precision": read_recipe(checkpoint).inference_precision,
                "readout": readout_summary(checkpoint)}

    return release_checkpoint(config, tracker, checkpoint=checkpoint, read_holdout=read, card=body,
                              round_key=round_key, run_tags=run_tags)


def readout_summary(checkpoint: Path) -> dict[str, Any]:
    """What the release's answers are made of, from its training metrics: the hybrid's lexical weight and the head's share.

    ``head_share`` is the head's part of the fused logits' spread on val
    (:func:`~envloop_pipelines.core.model.lexical.head_share`: 1.0 the head alone, 0.0 the TF-IDF part
    alone); ``val_nll_head_alone`` and ``val_nll`` are the calibrated val NLL at weight 0 and at the
    chosen weight. A checkpoint without the lexical part is the head alone.
    """
    import json

    metrics = json.loads((checkpoint / "metrics.json").read_text(encoding="utf-8"))
    lexical = (metrics.get("train") or {}).get("lexical")
    if not lexical:
        return {"hybrid": False, "head_share": 1.0}
    tried = lexical.get("val_nll_by_weight") or {}
    weight = lexical.get("weight")
    return {"hybrid": True, "lexical_weight": weight, "head_share": lexical.get("head_share"),
            "val_nll_head_alone": tried.get("0"), "val_nll": tried.get(f"{weight:g}") if weight is not None else None}


__all__ = ["HoldoutRead", "Release", "champion", "holdout_metrics", "publish_release", "readout_summary", "release_checkpoint",
           "tfidf_baseline"]
