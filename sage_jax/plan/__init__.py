"""The ahead-of-time planner, `python -m sage_jax.plan` (__main__.py): memory.py (compile the trainer's programs for
a mesh and read their memory), programs.py, cache.py, report.py, roofline.py (chips and the run's prediction),
phase_model.py (the RL step's phases priced), phase_check.py (the phase model against this machine's measured
steps), placements.py (colocated vs split rollout placements), padding.py (how much of a loss batch is padding).

Imports: any folder (the top floor). Must not import JAX at import time: `prepare` sets the platform first.
"""
