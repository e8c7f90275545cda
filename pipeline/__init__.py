"""How you drive the pipeline: a chained Click CLI over the stages in `stages/`."""
