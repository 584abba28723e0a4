"""The verifier side: the only code path that reads test and holdout labels."""
