"""The nightly and monitoring flows' stages as plain library calls: one function per Prefect task."""
