"""Training: the one loop that train and qat drive (loop), their time boxes (plans), how training
fails (failures), precision (autocast, GradScaler), the learning-rate range test, BatchNorm
handling, torch.distributed, memory.
Imports the layers below it (run, data, models, measure), never quantization or a runtime."""
