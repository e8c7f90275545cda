"""What the pipeline does. Folders by subsystem, lowest first; a folder imports only the ones
above it in this list (tests/test_layers.py reads every import and holds this):

    stages/run/            the run folder, checkpoints, errors, signals, progress, registries
    stages/data/           data sets and splits, an image file as the model's input
    stages/models/         building a model by name, its starting weights
    stages/measure/        the latency harness, contention, accuracy, statistics, the machine
    stages/training/       the one training loop, precision, lr range test, distributed
    stages/quantization/   the configuration search, per-layer sensitivity, equalization
    stages/runtimes/       one module per inference runtime behind one registry of variants
    stages/*.py, report/, export/   the stages, each a plain `run(config, run)`
"""
