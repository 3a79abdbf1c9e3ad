"""PythonTool's observations, Calculator (no eval), finding calls in the model's text, the tool pool."""

import pytest

from sage_jax.tools import Calculator, PythonTool, base, python_tool, registry, sandbox
from sage_jax.tools.calls import ToolCall, find_call

needs_namespaces = pytest.mark.skipif(sandbox.available_isolation() is None,
                                      reason="namespaces need root with unshare/mount/prlimit/setpriv")


@needs_namespaces
def test_python_tool_returns_stdout_and_the_last_traceback_line():
    tool = PythonTool(timeout_s=5.0)
    assert tool.run("import math\nprint(math.factorial(20))") == "2432902008176640000\n"
    assert tool.run("print('partial')\nx = {}['missing']") == "partial\nKeyError: 'missing'"
    assert tool.run("import sympy\nprint(sympy.factorint(360))") == "{2: 3, 3: 2, 5: 1}\n"


def test_python_tool_is_refused_where_nothing_can_isolate_it(monkeypatch):
    monkeypatch.setattr(python_tool, "_ISOLATION", [None])
    with pytest.raises(RuntimeError, match="isolation='none'"):
        PythonTool()
    with pytest.raises(ValueError, match="timeout_s"):
        PythonTool(timeout_s=0)


@pytest.mark.parametrize("expression, want", [("(17 * 23 + 4) / 5", "79.0"), ("-3 // 2", "-2"), ("2 ** 10", "1024"),
                                               ("factorial(10) % 1000", "800"), ("round(pi, 3)", "3.142")])
def test_calculator(expression, want):
    assert Calculator().run(expression) == want


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "9 ** 9 ** 9", "(10 ** 4000) ** 4000",
                                        "factorial(10 ** 6)", "1 / 0", "x + 1", "open('f')", "[1, 2]", "2 +"])
def test_calculator_refuses_what_is_not_small_arithmetic(expression):
    with pytest.raises(base.ToolCallError):
        Calculator().run(expression)


def test_find_call_markdown_takes_the_last_closed_block():
    text = "```python\na = 1\n```\n```output\n1\n```\nthen\n```python\nprint(a + 1)\n```\n"
    assert find_call(text, "markdown") == ToolCall("python", "print(a + 1)\n")
    assert find_call("```python\nx = 1\n``` and more words", "markdown") is None
    assert find_call("no code", "markdown") is None


def test_find_call_hermes_and_malformed_calls():
    call = find_call('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>', "hermes")
    assert call == ToolCall("calculator", {"expression": "2+2"})
    assert "not valid JSON" in find_call("<tool_call>{oops</tool_call>", "hermes").error
    assert "name" in find_call('<tool_call>["python"]</tool_call>', "hermes").error
    with pytest.raises(ValueError, match="format"):
        find_call("x", "xml")


def test_pool_turns_bad_calls_into_error_observations_and_counts_them():
    class Broken:
        name, schema = "broken", {}

        def parse(self, arguments):
            return arguments

        def run(self, payload):
            raise RuntimeError("tool fell over")

    with base.ToolPool({"calculator": Calculator(), "broken": Broken()}, num_workers=2) as pool:
        outs = [pool.submit(n, a).result() for n, a in [("calculator", {"expression": "6*7"}), ("calculator", {}),
                                                          ("broken", "x"), ("nope", "x")]]
        counts = pool.take_counts()
    assert outs[0].text == "42" and outs[0].ok
    assert [o.ok for o in outs[1:]] == [False] * 3
    assert "expression" in outs[1].text and "RuntimeError: tool fell over" in outs[2].text and "nope" in outs[3].text
    assert counts["tools/calls"] == 4 and counts["tools/errors"] == 3


def test_make_tools_names_the_choices():
    assert set(registry.make_tools(("calculator",))) == {"calculator"}
    with pytest.raises(ValueError, match="calculator"):
        registry.make_tools(("shell",))
