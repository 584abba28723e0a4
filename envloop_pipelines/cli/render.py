"""How the loop's commands print what the clients return: a round's verdict, the rounds' table, the release chain
and the ledger with its calibration per lever. Nothing here starts work; each function prints or returns lines.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from envloop_pipelines.cli.clients import local_client, sdk_call


def decision_lines(key: str, decision: Any, seconds: float | None = None) -> list[str]:
    """A round's verdict in words: the paired delta with its CI, the floor, and every reason of a refusal."""
    verdict = f"promoted as release {decision.release}" if decision.promote else "rejected"
    took = f"; {seconds:.0f}s" if seconds is not None else ""
    from envloop_pipelines.core.release.card import paired_text

    delta = paired_text(decision.delta) or f"{decision.delta['delta']:+.4f}"
    checks = decision.checks or {}
    bar, mde, half = checks.get("bar"), checks.get("mde"), checks.get("ci_half_width")
    bar_text = f", bar {bar:.4f}" if isinstance(bar, (int, float)) else ""
    if isinstance(mde, (int, float)):  # the registered MDE (80% power) beside the bar and this round's CI
        bar_text += f", MDE {mde:.4f}" + (f" vs CI half-width {half:.4f}" if isinstance(half, (int, float)) else "")
    lever = getattr(decision, "lever", None)
    tested = (f"lever {lever}, predicted {decision.predicted_delta:+.4f}, observed {decision.delta['delta']:+.4f}: "
              if lever and isinstance(decision.delta.get("delta"), (int, float)) else "")
    # The floor that gated the round: the control recipe's, or the champion's lineage floor (issue 45).
    floor = "lineage floor" if checks.get("noise_floor_source") == "lineage" else "floor"
    return [f"round {key}: {tested}{verdict} (delta {delta}, {floor} {decision.noise_floor:.4f}{bar_text}{took})",
            *(f"  - {reason}" for reason in decision.reasons)]


def echo_decision(key: str, decision: Any, seconds: float | None = None) -> None:
    for line in decision_lines(key, decision, seconds):
        click.echo(line)


def round_row(key: str, decision: Any, run_id: str | None, run_status: str | None,
              reason: str | None = None) -> dict[str, Any]:
    """One round as ``envloop round status`` shows it (``--json``: as it prints it): its status, its latest run, a
    failure's reason, and its verdict once decided."""
    row: dict[str, Any] = {"round": key, "status": "decided" if decision is not None else (run_status or "not started"),
                           "run_id": run_id, "run_status": run_status}
    if decision is None and run_status == "FAILURE":
        row["reason"] = reason or "unknown (the run's log has no failed step)"
    if decision is not None:
        row.update(promoted=decision.promote, release=decision.release, delta=decision.delta.get("delta"),
                   noise_floor=decision.noise_floor, reasons=list(decision.reasons))
    return row


def echo_rounds(task: str, rows: list[dict[str, Any]], as_json: bool = False) -> None:
    """The rounds as :func:`round_row` gives them: one line each (status, verdict, delta, floor, run; a failure's
    reason below it), or JSON."""
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo(f"task {task}: no rounds yet")
        return
    click.echo(f"{'round':<7} {'status':<12} {'verdict':<22} {'delta':>8} {'floor':>7}  run")
    for r in rows:
        if r["status"] == "decided":
            verdict = f"promoted: release {r['release']}" if r["promoted"] else "rejected"
            delta, floor = f"{r['delta']:+.4f}", f"{r['noise_floor']:.4f}"
        else:
            verdict, delta, floor = "-", "-", "-"
        run = f"{r['run_id']} ({r['run_status']})" if r["run_id"] else "-"
        click.echo(f"{r['round']:<7} {r['status']:<12} {verdict:<22} {delta:>8} {floor:>7}  {run}")
        if r.get("reason"):
            click.echo(f"        failed: {r['reason']}")


def echo_releases(task: str, releases: list[dict[str, Any]], as_json: bool = False) -> None:
    """The release chain: one card per release (holdout first, errata beside), or the cards as JSON."""
    if as_json:
        click.echo(json.dumps(releases, indent=2, default=str))
        return
    if not releases:
        click.echo(f"task {task}: no releases yet")
        return
    from envloop_pipelines.core.release.card import coverage_of

    budgets = {coverage_of(r.get("test"))[0] for r in releases} - {None}
    cov = f"cov@{budgets.pop():.0%}" if len(budgets) == 1 else "coverage"
    click.echo(f"release chain of {task}:")
    click.echo(f"{'release':>7}  {'round':<9} {'parent':>6}  {'holdout acc':>11} {'TF-IDF':>7} {'holdout brier':>13} "
               f"{'test acc':>8} {'TF-IDF':>7} {'test ' + cov:>12} {'TF-IDF':>7}  checkpoint")
    nan = float("nan")
    for r in releases:
        h, t = r.get("holdout") or {}, r.get("test") or {}
        ht, tt = r.get("holdout_tfidf") or {}, r.get("tfidf_baseline_test") or {}
        mine, theirs = coverage_of(t)[1], coverage_of(tt)[1]
        champion = "  (champion)" if r.get("champion") else ""
        click.echo(f"{r['release']:>7}  {r.get('round') or '-':<9} {r.get('parent_release') or '-'!s:>6}  "
                   f"{h.get('family_macro_accuracy', nan):>11.4f} {ht.get('family_macro_accuracy', nan):>7.4f} "
                   f"{h.get('brier', nan):>13.4f} {t.get('family_macro_accuracy', nan):>8.4f} "
                   f"{tt.get('family_macro_accuracy', nan):>7.4f} {nan if mine is None else mine:>12.4f} "
                   f"{nan if theirs is None else theirs:>7.4f}  {str(r.get('checkpoint_sha256'))[:12]}{champion}")
        for e in r.get("errata", []):
            click.echo(f"         erratum {e['erratum']}: {e['field']} {e['old']} -> {e['new']} ({e['reason']})")


def echo_champion_vs_tfidf(task: str, client: Any = None) -> None:
    """What the champion answers on its own (coverage at the error budget, test), then, the last line, its holdout
    family-macro accuracy beside TF-IDF + LR's, paired, from its one read."""
    from envloop_pipelines.core.release.card import answers_on_its_own, paired_text

    releases = (client or local_client(task=task)).release_cards()
    if not releases:
        return
    card = releases[-1]
    on_its_own = answers_on_its_own(card)
    if on_its_own:
        click.echo(on_its_own)
    metric = "family_macro_accuracy"
    mine, theirs = (card.get("holdout") or {}).get(metric), (card.get("holdout_tfidf") or {}).get(metric)
    if mine is None or theirs is None:
        return
    text = paired_text((card.get("holdout_vs_tfidf") or {}).get(metric))
    paired = f", paired {text}" if text else ""
    verdict = "at or above" if mine >= theirs else "BELOW"
    click.echo(f"champion (release {card['release']}) on the holdout: {metric} {mine:.4f}, TF-IDF + LR {theirs:.4f}"
               f"{paired}: {verdict} the classical baseline")


def print_releases(task: str, as_json: bool = False, client: Any = None) -> None:
    """The release chain of ``client`` (default: this home's ``task``), as :func:`echo_releases` prints it."""
    client = client or local_client(task=task)
    echo_releases(client.task, sdk_call(client.release_cards), as_json)


def echo_ledger(events: list[dict[str, Any]], as_json: bool, *, calibration: bool = True) -> None:
    """The ledger's events, one line each (or JSON), then the calibration per lever (:func:`calibration_lines`)."""
    if as_json:
        click.echo(json.dumps(events, indent=2, default=str))
        return
    for e in events:
        detail = {k: v for k, v in e.items() if k not in ("event_id", "at", "kind", "task", "candidate", "champion")}
        click.echo(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(e['at']))}  {e['kind']:<22} "
                   f"{json.dumps(detail, default=str)[:200]}")
    if calibration:
        for line in calibration_lines(events):
            click.echo(line)


def calibration_lines(events: list[dict[str, Any]]) -> list[str]:
    """The loop's prediction calibration per lever (``proposer.calibration_rows``), as a table, then the gate's
    measured operating point at the loop's design (``core.loop.operating_point``: false promotions and power, or
    that none is on record there); empty when no round of a lever is decided."""
    from envloop_pipelines.core.decision_loop.proposer import calibration_rows, lever_records
    from envloop_pipelines.core.loop.operating_point import (
        design_from_events, measured_operating_point, operating_point_text)

    rows = calibration_rows(lever_records(events))
    if not rows:
        return []
    design = design_from_events(events)
    point = None if design is None else measured_operating_point(**design)

    def secs(v: Any) -> str:
        return "-" if v is None else f"{v:.0f}"

    lines = ["prediction calibration by lever (observed minus predicted delta; inside: observed in the registered range):",
             f"{'lever':<14}{'rounds':>7}{'promoted':>9}{'predicted':>11}{'observed':>10}{'error':>9}{'inside':>8}"
             f"{'pred s':>8}{'spent s':>9}"]
    for r in rows:
        lines.append(f"{r['lever']:<14}{r['rounds']:>7}{r['promoted']:>9}{r['mean_predicted']:>+11.4f}"
                     f"{r['mean_observed']:>+10.4f}{r['mean_error']:>+9.4f}{r['inside_range']:>8}"
                     f"{secs(r['predicted_seconds']):>8}{secs(r['spent_seconds']):>9}")
    lines.append(operating_point_text(point) if design is not None else
                 "the gate's operating point: this ledger's rounds do not name their design (registered before issue 45)")
    return lines


__all__ = ["calibration_lines", "decision_lines", "echo_champion_vs_tfidf", "echo_decision", "echo_ledger",
           "echo_releases", "echo_rounds", "print_releases", "round_row"]
