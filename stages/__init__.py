"""What the pipeline does: the training, quantization and report steps and the tools they share."""
