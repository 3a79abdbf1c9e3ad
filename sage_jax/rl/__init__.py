"""The RL objective: advantages.py (group-normalized), guides.py (SAGE's q: Branch, Token, Random, ...),
objectives.py (the clipped surrogate with the guide-weighted KL anchor: loss_fn, kl_term), packing.py (the loss
batch's layout: rows packed with segment ids or grouped by length).

Imports: models/.
"""
