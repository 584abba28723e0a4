"""A notebook session with the SDK only: set up, run a round with progress, cancel one, retry it, read a refused
hypothesis's reason, and predict with the champion.

Run it against a deployment (a Dagster webserver loading ``envloop_pipelines.definitions`` and an MLflow server)::

    python examples/notebook_sdk.py http://127.0.0.1:3000 http://127.0.0.1:5000

or paste its cells into a notebook. ``ENVLOOP_REMOTE`` and ``MLFLOW_TRACKING_URI`` stand in for the arguments.
The rounds are small when the deployment's loop is (``ENVLOOP_RECIPE_OVERRIDES``); the progress lines go to
stderr, where a notebook shows them.
"""

import json
import os
import sys
import time

from envloop_pipelines.sdk import Client, RefusedError, RoundFailed

dagster_url = sys.argv[1] if len(sys.argv) > 1 else os.environ["ENVLOOP_REMOTE"]
mlflow_uri = sys.argv[2] if len(sys.argv) > 2 else os.environ["MLFLOW_TRACKING_URI"]
client = Client(dagster_url, mlflow_uri=mlflow_uri)
print("deployment:", client.loop_settings()["task"], "at", dagster_url)

# %% the setup (benchmark, noise floor, release 1); cached, so cheap the second time
if not client.is_set_up():
    client.setup()
print("set up:", client.is_set_up(), "| promotion warning:", client.promotion_warning())

# %% a hypothesis with a typo is refused before anything is launched or registered; the reason names the field
typo = {"change": {"kind": "recipe", "recipe_diff": {"max_stepz": 3}}, "predicted_delta": 0.02,
        "rationale": "a typo in the recipe key"}
before = client.round_keys()
try:
    client.start_round(typo)
except RefusedError as exc:
    print("refused:", exc)
assert client.round_keys() == before, "a refused hypothesis left a round behind"

# %% a round, watched with progress until its decision
hypothesis = {"change": {"kind": "recipe", "recipe_diff": {"max_steps": 3}}, "predicted_delta": 0.02,
              "gate": {"primary_metric": "family_macro_accuracy", "min_delta": 0.01},
              "rationale": "the champion is under-trained"}
launched = client.start_round(hypothesis)
print("started:", launched.key, "run", launched.run_id)
run = client.wait(launched.run_id, poll_s=1.0)
decision = client.decision(launched.key)
print(f"{launched.key}: run {run.status};", "promoted" if decision.promote else "rejected", "-", "; ".join(decision.reasons))

# %% a second round, cancelled once its hypothesis is registered
second = client.start_round({**hypothesis, "rationale": "the same change, to cancel and retry"})
print("started:", second.key, "run", second.run_id)
while {s.key: s.status for s in client.run(second.run_id).steps}.get("registered_hypothesis") != "SUCCESS":
    if client.run(second.run_id).finished:  # it ended before we could cancel it: say why
        raise SystemExit(f"{second.key}: run ended {client.run(second.run_id).status}: {client.run_error(second.run_id)}")
    time.sleep(0.5)
cancelled = client.cancel(second.run_id)
print(f"{second.key}: cancelled, run {cancelled.status}; steps:",
      ", ".join(f"{s.key}={s.status}" for s in cancelled.steps))
print("its last log lines:", *client.logs(second.run_id, tail=3), sep="\n  ")

# %% retried from where it stopped (the steps that succeeded are not run again), to its decision
try:
    retried = client.retry(second.key, wait=True)
    print(f"{second.key}: retried as run {retried.run.run_id} (parent {retried.run.tags.get('dagster/parent_run_id')});",
          "promoted" if retried.decision.promote else "rejected", "-", "; ".join(retried.decision.reasons))
except RoundFailed as exc:
    print("the retry failed:", exc, "| reason:", exc.reason)
    print(*client.logs(exc.run.run_id, tail=15), sep="\n  ")

# %% the rounds so far, and the champion
for r in client.rounds():
    print(f"  {r.key}: {r.status} (run {r.run.status if r.run else None})")
champion = client.champion()
print("champion: release", champion.release, "from round", champion.round, "holdout", champion.holdout)

# %% predict with the champion, here in this process (the same numbers `envloop serve` gives)
request = {"state": "Order #1182 was charged twice; the customer asks for a refund of the duplicate charge.",
           "questions": {"queue": {"type": "choice", "instructions": "Which queue handles this?",
                                   "criteria": {"billing": "Payments and refunds", "shipping": "Deliveries",
                                                "account": "Logins and profiles"}},
                         "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}
answer = client.predict(request)
print("predict:", json.dumps(answer["answers"], sort_keys=True)[:600])
print("checkpoint:", answer.get("x_checkpoint_sha256"))
try:
    client.predict({"state": "s", "questions": {"q": {"type": "banana", "instructions": "?"}}})
except RefusedError as exc:
    print("a bad request is refused:", str(exc)[:300])
client.close()
