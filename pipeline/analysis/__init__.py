"""Stage 3: metrics of runs, comparison of runs, read-only SQL and the report."""
