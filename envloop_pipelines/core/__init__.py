"""Pure domain code. Nothing under ``core`` imports Dagster (a test proves it)."""
