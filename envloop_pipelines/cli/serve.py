"""``envloop serve``: serve a checkpoint or a release over the Jev API and an OpenAI-compatible chat.

Registered in ``cli.py`` with ``main.add_command(serve)``; also runnable alone:
``python -m envloop_pipelines.cli.serve --checkpoint DIR --auth-off``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


def _release(value: str | None) -> int | str | None:
    if value is None or value == "champion":
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise click.BadParameter(f"expected a release number (1, 2, ...) or 'champion', got {value!r}", param_hint="--release")


@click.command("serve")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Serve this checkpoint directory (instead of a release).")
@click.option("--release", "release", default=None, metavar="N|champion",
              help="Serve release N of --task, or its champion (the latest release). Default with --task: champion.")
@click.option("--task", default=None, help="The task whose release chain --release reads.")
@click.option("--policy", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Serve a policy checkpoint (a causal LM's LoRA from an RL round) on the OpenAI chat with tool calls.")
@click.option("--base-model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="With --policy: the base model directory (default: its recipe's). Alone: serve this causal LM as is.")
@click.option("--max-tokens", type=int, default=512, show_default=True,
              help="Policy serving: the most tokens one completion generates (larger requests are clamped).")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="EnvLoop home (default: $ENVLOOP_HOME or ./.envloop).")
@click.option("--model-id", default=None, help="Versioned model id to answer with (default: envloop-<task>-r<NNNN>).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0 picks a free port (see --port-file).")
@click.option("--port-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the bound port here once listening.")
@click.option("--keys-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="API keys, one per line ('#' comments); $ENVLOOP_SERVE_KEYS adds more.")
@click.option("--auth-off", is_flag=True, help="Serve without keys (every route open). Must be explicit.")
@click.option("--idle-timeout", type=float, default=900.0, show_default=True,
              help="Seconds idle before the model is unloaded (scale to zero); 0 never unloads.")
@click.option("--lazy", is_flag=True, help="Load the model on the first request instead of at startup.")
@click.option("--max-batch", type=int, default=64, show_default=True, help="Questions per gathered batch.")
@click.option("--forward-batch", type=int, default=None,
              help="Questions per forward pass (default: --max-batch on a GPU, 16 on CPU).")
@click.option("--max-wait-ms", type=float, default=5.0, show_default=True, help="Bounded wait of a batch for company.")
@click.option("--no-batching", is_flag=True, help="Run every request alone (micro-batching off).")
@click.option("--max-queue", type=int, default=256, show_default=True, help="Questions allowed to wait; beyond: 529.")
@click.option("--max-inflight-per-key", type=int, default=0, show_default=True,
              help="Requests in flight per key; beyond: 429. 0: no limit.")
@click.option("--max-body-bytes", type=int, default=4 * 1024 * 1024, show_default=True, help="Beyond: 413.")
@click.option("--max-questions", type=int, default=128, show_default=True, help="Questions per request; beyond: 422.")
@click.option("--request-timeout", type=float, default=120.0, show_default=True, help="Seconds before a 504 timeout.")
@click.option("--graceful-timeout", type=float, default=30.0, show_default=True,
              help="On SIGTERM, seconds in-flight requests may take to finish.")
@click.option("--threads", type=int, default=None, help="torch threads (default: torch's).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info", show_default=True)
def serve(checkpoint: Path | None, release: str | None, task: str | None, policy: Path | None, base_model: Path | None,
          max_tokens: int, home: Path | None, model_id: str | None,
          host: str, port: int, port_file: Path | None, keys_file: Path | None, auth_off: bool, idle_timeout: float,
          lazy: bool, max_batch: int, forward_batch: int | None, max_wait_ms: float, no_batching: bool, max_queue: int, max_inflight_per_key: int,
          max_body_bytes: int, max_questions: int, request_timeout: float, graceful_timeout: float, threads: int | None, log_level: str) -> None:
    """Serve a checkpoint or a release: POST /v1/systemone, /v1/chat/completions, GET /v1/models, /health, /metrics.

    With --policy DIR (or --base-model DIR): a causal LM (+ LoRA) on POST /v1/chat/completions with tool calls.
    """
    if policy is not None or base_model is not None:
        if checkpoint is not None or release is not None or task is not None:
            raise click.UsageError("--policy/--base-model serve a causal LM; --checkpoint/--release/--task a decision model")
        _serve_policy(policy, base_model, model_id=model_id, keys_file=keys_file, auth_off=auth_off, host=host, port=port,
                      port_file=port_file, max_tokens=max_tokens, max_body_bytes=max_body_bytes,
                      request_timeout=request_timeout, graceful_timeout=graceful_timeout, threads=threads,
                      log_level=log_level)
        return
    from envloop_pipelines.core.serve.server import run
    from envloop_pipelines.core.serve.settings import (
        SettingsError,
        load_api_keys,
        settings_for,
        source_from_checkpoint,
        source_from_release,
    )

    if checkpoint is not None and (release is not None or task is not None):
        raise click.UsageError("give either --checkpoint DIR or --release N|champion --task NAME, not both")
    if checkpoint is None and task is None:
        raise click.UsageError("nothing to serve: give --checkpoint DIR, or --task NAME (with --release N|champion)")
    try:
        if checkpoint is not None:
            source = source_from_checkpoint(checkpoint, model_id=model_id)
        else:
            source = source_from_release(task, _release(release) or "champion", home=home, model_id=model_id)  # type: ignore[arg-type]
        settings = settings_for(
            source,
            api_keys=load_api_keys(keys_file),
            auth_off=auth_off,
            host=host,
            port=port,
            port_file=port_file,
            idle_timeout_s=idle_timeout if idle_timeout > 0 else None,
            preload=not lazy,
            micro_batching=not no_batching,
            max_batch=max_batch,
            forward_batch=forward_batch,
            max_wait_ms=max_wait_ms,
            max_queue=max_queue,
            max_inflight_per_key=max_inflight_per_key or None,
            max_body_bytes=max_body_bytes,
            max_questions=max_questions,
            request_timeout_s=request_timeout,
            graceful_shutdown_s=graceful_timeout,
            torch_threads=threads,
            log_level=log_level,
        )
    except (SettingsError, LookupError, FileNotFoundError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    run(settings)


def _serve_policy(policy: Path | None, base_model: Path | None, *, model_id: str | None, keys_file: Path | None,
                  auth_off: bool, host: str, port: int, port_file: Path | None, max_tokens: int, max_body_bytes: int,
                  request_timeout: float, graceful_timeout: float, threads: int | None, log_level: str) -> None:
    from envloop_pipelines.core.serve.generation import policy_settings, run_policy
    from envloop_pipelines.core.serve.settings import load_api_keys

    try:
        settings = policy_settings(policy, base_model=base_model, model_id=model_id, api_keys=load_api_keys(keys_file),
                                   auth_off=auth_off, host=host, port=port, port_file=port_file, max_tokens=max_tokens,
                                   max_body_bytes=max_body_bytes, request_timeout_s=request_timeout,
                                   graceful_shutdown_s=graceful_timeout, torch_threads=threads, log_level=log_level)
    except (ValueError, FileNotFoundError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    run_policy(settings)


if __name__ == "__main__":  # pragma: no cover - ``python -m envloop_pipelines.cli.serve``
    serve()
