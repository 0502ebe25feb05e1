"""The nightly and monitoring flows' stages as plain library calls (`pipeline.stages`: one function per Prefect
task), and what they share: configs, stage records, budgets, the report."""
