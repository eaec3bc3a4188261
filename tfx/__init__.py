"""tfx: a JAX/Flax functional research framework for pretraining transformer language models."""

__version__ = "0.1.0"
