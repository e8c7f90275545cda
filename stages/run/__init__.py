"""What every stage's run stands on: the run folder (manifest, atomic writes, safe loading,
the lock), checkpoints, errors, signals, progress and the name registries.
Imports nothing else from stages/."""
