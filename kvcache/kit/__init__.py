"""Conformance and benchmarking kit: workloads, a scheduler simulation, adapters.

Nothing here is imported by ``kvcache`` itself; the manager stays free of it.
"""
