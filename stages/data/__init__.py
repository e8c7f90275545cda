"""Data: the data sets and their seeded splits (the default set ships here as digits.npz), their
loaders, the calibration and selection images, and how an image file becomes a model's input
(preprocess, numpy and Pillow only).
Imports only stages.run."""
