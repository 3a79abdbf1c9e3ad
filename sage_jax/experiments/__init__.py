"""Studies built on the library, `python -m sage_jax.experiments.<name>`: reproduce.py (the CPU-scale SAGE
comparison), regime.py, task_choice.py, measure.py, report.py, stats.py, plots.py, text.py, worklist.py.

Imports: any core folder (top floor, beside bench/ and plan/).
"""
