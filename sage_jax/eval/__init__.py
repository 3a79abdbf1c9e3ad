"""Evaluation: passk.py (the unbiased pass@k estimator and the evaluation pass), source.py (a model to evaluate: an HF
directory or a training workdir).

Imports: sampling/, run/, data/, rewards/, models/.
"""
