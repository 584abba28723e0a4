"""The loop: failure mining, synthesis, hypotheses, the noise floor, promotion, the ledger."""
