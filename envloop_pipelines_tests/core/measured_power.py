"""The power a test's hypothesis records when the test registers it in the ledger directly.

``Ledger.register_hypothesis`` refuses a hypothesis without a minimum detectable effect (``power.mde``), as
the registration step does; tests that build a ``Hypothesis`` by hand give it this power, shaped as
``promotion.hypothesis_power`` measures one.
"""

from __future__ import annotations

from typing import Any


def measured_power(predicted_delta: float = 0.01, *, mde: float = 0.005, se: float = 0.0018,
                   metric: str = "family_macro_accuracy") -> dict[str, Any]:
    """A measured power: ``mde`` at ``se``, ``underpowered`` when ``predicted_delta`` is below it."""
    return {"metric": metric, "predicted_effect": predicted_delta, "power": 0.8, "mde": mde, "se": se,
            "underpowered": predicted_delta < mde, "source": "a test's fixed paired se"}
