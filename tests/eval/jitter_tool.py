"""A tool whose calls take a random time (the multi-process tool-loop workers'): which calls have answered at a given
moment differs run to run."""

import random
import threading
import time

from sage_jax.tools.base import ToolOutput


class JitterTool:
    schema = {}

    def __init__(self, name: str, max_wait_s: float):
        self.name, self.max_wait_s = name, max_wait_s
        self.calls, self.lock = 0, threading.Lock()

    def parse(self, arguments):
        return arguments

    def execute(self, payload):
        time.sleep(random.uniform(0.0, self.max_wait_s))
        with self.lock:
            self.calls += 1
        return ToolOutput(f"ok {payload['n']}" if "n" in payload else "ok", seconds=self.max_wait_s / 2)
