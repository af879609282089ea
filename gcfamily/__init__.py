"""gcfamily: one engine for the gradient-coefficient family of post-training methods."""

__version__ = "0.1.0"
