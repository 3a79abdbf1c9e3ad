"""PythonTool: the model's code run in sandbox.py; stdout and the last line of a traceback come back.

    PythonTool(timeout_s=5.0).run("import math\\nprint(math.factorial(20))")   # '2432902008176640000\\n'
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from sage_jax.tools import sandbox
from sage_jax.tools.base import ToolOutput, text_argument

log = logging.getLogger("sage_jax")
_ISOLATION: list[str | None] = []  # probed once per process
SCHEMA = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints (stdout) and the last error line.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                   "required": ["code"]}}}


class PythonTool:
    name = "python"
    schema = SCHEMA

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 1024, max_processes: int = 16, max_file_mb: int = 8,
                 max_output_bytes: int = 16384, isolation: str = "auto"):
        """isolation: "auto" (namespaces, refused with the reason where the machine cannot build them),
        "namespaces", or "none" (trusted code only: resource limits, no network or file isolation)."""
        if not timeout_s > 0:
            raise ValueError(f"PythonTool timeout_s must be > 0, got {timeout_s}")
        if isolation not in ("auto", "namespaces", "none"):
            raise ValueError(f"PythonTool isolation must be 'auto', 'namespaces' or 'none', got {isolation!r}")
        if isolation != "none":
            if not _ISOLATION:
                _ISOLATION.append(sandbox.available_isolation())
            if _ISOLATION[0] is None:
                raise RuntimeError(
                    "PythonTool cannot isolate model-written code here: it needs root with `unshare`, `mount`, "
                    "`prlimit` and `setpriv` (util-linux) to build network, mount and PID namespaces. Run as root "
                    "(as CI does), or pass isolation='none' for trusted code only (limits, no isolation)")
            isolation = "namespaces"
        else:
            log.warning("PythonTool(isolation='none'): code runs with resource limits only, no network or file "
                        "isolation; use it for trusted code only")
        self.isolation = isolation
        self.limits = sandbox.Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes,
                                     max_file_mb=max_file_mb)
        self.max_output_bytes = max_output_bytes

    def parse(self, arguments: Any) -> str:
        return text_argument(arguments, "code", 'the python tool takes code: a ```python block or {"code": "..."}')

    def execute(self, code: str) -> ToolOutput:
        r = sandbox.run_isolated(code, self.limits, self.isolation, self.max_output_bytes)
        text, ok = r.stdout, r.returncode == 0
        if text and not text.endswith("\n") and (r.timed_out or r.returncode):
            text += "\n"
        if r.timed_out:
            text += f"TimeoutError: the code ran past {self.limits.timeout_s:g} s and was stopped"
        elif r.returncode < 0:
            try:
                name = signal.Signals(-r.returncode).name
            except ValueError:
                name = f"signal {-r.returncode}"
            text += f"Error: the process was killed by {name}"
        elif r.returncode != 0:
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            text += lines[-1] if lines else f"Error: exit status {r.returncode}"
        return ToolOutput(text, ok=ok and not r.timed_out, timed_out=r.timed_out, seconds=r.seconds)

    def run(self, code: str) -> str:
        return self.execute(code).text
