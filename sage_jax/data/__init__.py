"""Problem sets (loaders.py, tfds_builders.py, word_problems.py), prompt templates (templates.py), tokenizers
(tokenizer.py), multi-turn rows of sampled and observed segments (segments.py) and tasks (tasks.py: a problem set,
its reward and its tokenizer together). Import-light: no jax or tensorflow_datasets at import.

Imports: rewards/, models/ (hf_config: the eos ids a model directory names), tools/ (the tools' schemas for
the chat template's `tools=`).
"""

from sage_jax.data.loaders import DATASETS, Example, load_dataset, load_file
from sage_jax.data.templates import TEMPLATES, render

__all__ = ["DATASETS", "Example", "TEMPLATES", "load_dataset", "load_file", "render"]
