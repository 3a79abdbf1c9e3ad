"""What a tool is, and the pool that runs calls while decoding goes on.

A tool is any object with `name`, `schema` (the JSON schema of a function, as the chat template's `tools=` takes it),
`parse(arguments) -> payload` (the call's arguments: a code block's text or a JSON object; raises ToolCallError with a
message the model reads) and `run(payload) -> str`. It may also have `execute(payload) -> ToolOutput` (PythonTool does,
to report timeouts). A call that cannot be parsed or whose tool raises becomes an error observation: the row goes on.

    pool = ToolPool({"python": PythonTool(timeout_s=5.0)}, num_workers=4)
    future = pool.submit("python", "print(1 + 1)")     # runs in a thread (the code itself in a sandboxed process)
    future.result().text                               # '2\\n'
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Protocol, Sequence


class ToolCallError(ValueError):
    """A call the tool cannot take (bad arguments); its message goes back to the model as the observation."""


def text_argument(arguments: Any, key: str, usage: str) -> str:
    """A tool's one text argument: the call's text (a code block), or a JSON object's `key`; else ToolCallError(usage),
    which the model reads."""
    if isinstance(arguments, dict):
        arguments = arguments.get(key)
    if not isinstance(arguments, str) or not arguments.strip():
        raise ToolCallError(usage)
    return arguments


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    text: str
    ok: bool = True
    timed_out: bool = False
    seconds: float = 0.0


class Tool(Protocol):
    name: str
    schema: dict

    def parse(self, arguments: Any) -> Any: ...

    def run(self, payload: Any) -> str: ...


def call_tool(tool: Tool, arguments: Any) -> ToolOutput:
    """Parses and runs one call; never raises: a bad call or a failing tool is an error observation."""
    start = time.perf_counter()
    try:
        payload = tool.parse(arguments)
        if hasattr(tool, "execute"):
            return tool.execute(payload)
        return ToolOutput(str(tool.run(payload)), seconds=time.perf_counter() - start)
    except ToolCallError as e:
        return ToolOutput(f"Error: {e}", ok=False, seconds=time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - a user tool's failure is the model's observation, not the trainer's crash
        return ToolOutput(f"Error: {type(e).__name__}: {str(e)[:300]}", ok=False,
                          seconds=time.perf_counter() - start)


class ToolPool:
    """Calls run in `num_workers` threads (PythonTool's code in its own sandboxed process), so the caller, the decode
    loop, goes on while they run. Counts calls, errors, timeouts and tool seconds for the step's metrics."""

    def __init__(self, tools: dict[str, Tool], num_workers: int = 4):
        self.tools = dict(tools)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, num_workers),
                                                               thread_name_prefix="sage_tool")
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "errors": 0, "timeouts": 0, "seconds": 0.0}

    def submit(self, name: str, arguments: Any) -> concurrent.futures.Future:
        return self._executor.submit(self._call, name, arguments)

    def _call(self, name: str, arguments: Any) -> ToolOutput:
        tool = self.tools.get(name)
        if tool is None:
            out = ToolOutput(f"Error: no tool named {name!r}; the tools are {sorted(self.tools)}", ok=False)
        else:
            out = call_tool(tool, arguments)
        with self._lock:
            self._counts["calls"] += 1
            self._counts["errors"] += int(not out.ok)
            self._counts["timeouts"] += int(out.timed_out)
            self._counts["seconds"] += out.seconds
        return out

    def take_counts(self) -> dict[str, float]:
        """{"tools/calls", "tools/errors", "tools/timeouts", "tools/seconds"} since the last take."""
        with self._lock:
            counts, self._counts = self._counts, {"calls": 0, "errors": 0, "timeouts": 0, "seconds": 0.0}
        return {f"tools/{k}": float(v) for k, v in counts.items()}

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "ToolPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
