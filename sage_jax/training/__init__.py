"""Training: trainer.py (rl_step and the RL loop), rollouts.py (prompts -> completions -> rewards), offpolicy.py (the
rollout of step t + 1 while step t trains), partial.py (partial rollouts: the rows still running when a step's groups
are complete carry into the next step), tool_rollouts.py (rollout.tools: the run's sampler in eval/tool_loop.py's
loop, where rows pause at tool calls and resume with the output as observed tokens), state.py (the train state and
the jitted update), supervised.py (SFT), preflight.py (what the `train` and `sft` faces check before the run writes or loads anything),
step_timing.py.

Imports: every core folder (models, tools, sampling, rl, run, eval, data, rewards); nothing imports training but the
faces, bench/, experiments/ and plan/.
"""
