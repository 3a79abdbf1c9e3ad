"""Evaluation: passk.py (the unbiased pass@k estimator and the evaluation pass), source.py (a model to evaluate: an HF
directory or a training workdir), tool_loop.py (rollouts with tool calls: rows pause at a call, the tool runs, they
resume with its output; used by training's rollout.tools and by tool_eval.py, evaluation with --tools).

Imports: sampling/, run/, data/, rewards/, models/, tools/.
"""
