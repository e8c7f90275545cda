"""Models: building one by name (built-in, torchvision, a user's own), the built-in ones, and the
weights a model starts from. Imports only stages.run."""
