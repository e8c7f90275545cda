"""Measurement: the one latency harness (timing), what other processes took meanwhile
(contention), accuracy and logit comparison (evaluate), statistics, and the machine.
Imports stages.run, stages.data and stages.models."""
