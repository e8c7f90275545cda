"""The quantization search the runtimes share: the configuration search (tuning), each layer's
own int8 error (sensitivity), cross-layer equalization.
Imports the layers below it (run, data, models, measure), never training or a runtime."""
