"""Problem sets, prompt templates and TFDS builders (import-light: no jax / tensorflow_datasets at import)."""

from sage_jax.data.loaders import DATASETS, Example, load_dataset, load_file
from sage_jax.data.templates import TEMPLATES, render

__all__ = ["DATASETS", "Example", "TEMPLATES", "load_dataset", "load_file", "render"]
