"""Studies built on the library, `python -m sage_jax.experiments.<name>`: reproduce.py (the CPU-scale SAGE
comparison), regime.py, task_choice.py, measure.py, report.py, stats.py, plots.py, text.py, worklist.py;
smollm2_study.py (GRPO against Branch on SmolLM2-135M-Instruct: smollm2_run.py, smollm2_regime.py, smollm2_report.py).

Imports: any core folder (top floor, beside bench/ and plan/).
"""
