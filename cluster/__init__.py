"""fairtick past one machine: N engines as Ray Serve replicas behind one OpenAI-compatible
endpoint, routed by the load each engine reports (docs/cluster.md, ADR 0013).

This package imports Ray (`pip install -e .[cluster]`); nothing under server/, runtime/ or
statemachine/ imports it, so `fairtick serve` runs without Ray installed.
"""
