"""The machinery the stages and runtimes share: the run folder, data, models, precision, the
latency harness, statistics and the configuration search. Nothing here imports a stage."""
