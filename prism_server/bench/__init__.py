"""The lab test bench: workloads and (coming) trace replay over HTTP; imports nothing of the
engine."""
