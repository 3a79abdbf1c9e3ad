"""Verifiable rewards: math.py / math_answer.py (boxed answers, math-verify with a sympy fallback), kk.py (Knights and
Knaves), countdown*.py, pool.py (scoring in worker processes with a time and memory limit per item).

Imports: nothing else of sage_jax (the bottom floor). Model output is untrusted text: nothing here evaluates it.
"""
