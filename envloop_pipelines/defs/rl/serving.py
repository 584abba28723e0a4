"""The policy server the RL round is given: ``envloop serve``'s policy app, in a thread of this process.

The loop (``core/rl_loop/round_steps.py``) takes any :class:`~envloop_pipelines.core.rl_loop.round_steps.PolicyServer`;
this is the one the assets pass in, so the loop never imports the serving layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serve_policy(policy: str | None, *, base_model: str, model_id: str, max_tokens: int) -> Iterator[str]:
    """Serve a policy checkpoint (its folder; its recipe names the base model) or, with ``policy=None``, the bare
    ``base_model`` on a free loopback port, auth off; yields the OpenAI base URL."""
    from envloop_pipelines.core.serve.generation import policy_settings, serving_policy

    settings = policy_settings(policy, base_model=None if policy else base_model, model_id=model_id, auth_off=True,
                               port=0, max_tokens=max_tokens)
    with serving_policy(settings) as url:
        yield url


__all__ = ["serve_policy"]
