"""python -m sage_jax.evaluate with tools, in process: samples pause at their calls, the tools run, the samples resume
with the output as observed tokens; pass@k reads the model's own text only; samples.jsonl holds each turn."""

import json
from pathlib import Path

import numpy as np
import pytest

from sage_jax import evaluate
from sage_jax.eval import offline as ev
from sage_jax.eval import passk as evaluation
from sage_jax.eval import tool_loop
from sage_jax.sampling import sampler
from sage_jax.tools.base import ToolOutput
from tests.training.test_tool_rollouts import call_path_only
from tests.helpers_chat_templates import family_tokenizer
from tests.eval.test_offline import _error, _main  # evaluate's command line and its one-line errors
from tests.helpers_hf import tiny_hf_model

PROBLEMS = {"What is 6 * 7?": "42", "What is 2 + 3?": "5"}
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
ORACLE = '<tool_call>\n{"name": "oracle", "arguments": {}}\n</tool_call>'
FAST = ["--n", "4", "--k", "1,2,4", "--max-new-tokens", "128", "--reward-workers", "0", "--dtype", "float32",
        "--no-progress", "--template", "chat", "--tools", "calculator", "--tool-format", "hermes"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny random Qwen2 with a Qwen2.5-family tokenizer (`</tool_call>` one token, the template's tool turns)."""
    path = tmp_path_factory.mktemp("qwen_tools")
    tok = family_tokenizer("qwen2.5")
    tok.save_pretrained(path)
    tiny_hf_model(path, vocab=len(tok))
    for name in ("config.json", "generation_config.json"):  # its stop ids: <|im_end|> only (id 3 is <tool_call>)
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
        (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "arith"
    folder.mkdir()
    with open(folder / "test.jsonl", "w") as f:
        for q, a in PROBLEMS.items():
            f.write(json.dumps({"problem": q, "answer": a}) + "\n")
    return folder



class Oracle:
    """A tool whose output holds the right answer in the reward's own form: a reward that read tool output would
    count the sample correct."""
    name, schema = "oracle", {}

    def parse(self, arguments):
        return arguments

    def run(self, payload):
        return "\\boxed{5}"


def _scripted_sampler(monkeypatch, hf):
    """sampler.generate's interface over scripted rows: a 6 * 7 prompt's rows call the calculator, then answer in
    their own text; a 2 + 3 prompt's rows call the oracle and never state the answer. Resumed rows must carry their
    ids back (checked) and go on where their script left off; what they carried is kept for the test."""
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    scripts = {True: hf.encode(CALC + "The answer is \\boxed{42}.", add_special_tokens=False) + [eos],
               False: hf.encode(ORACLE + "I trust the tool.", add_special_tokens=False) + [eos]}
    cursor, carried_back = {}, []

    def generate(cfg, params, prompts, num_samples, resume=(), row_max_new_tokens=None, eos_ids=(), **kw):
        C = kw["max_new_tokens"]
        fresh = [(list(p), b * num_samples + g, []) for b, p in enumerate(prompts) for g in range(num_samples)]
        rows = fresh + [(list(r.prompt), r.row_id, list(r.tokens)) for r in resume]
        carried_back.extend(list(r.tokens) for r in resume)
        out = {k: [] for k in ("tokens", "logprobs", "lengths", "finished")}
        for i, (prompt, row_id, carried) in enumerate(rows):
            script = scripts["6 * 7" in hf.decode(prompt)]
            throwaway = i < len(fresh) and row_max_new_tokens is not None  # a resume call's one-token row
            key = ("throwaway",) if throwaway else (tuple(prompt), row_id)
            new, at = [], cursor.get(key, 0)
            while len(carried) + len(new) < (1 if throwaway else C) and at < len(script):
                new.append(script[at])
                at += 1
                if new[-1] in eos_ids:
                    break
            cursor[key] = at
            ids = carried + new
            out["tokens"].append(ids + [0] * (C - len(ids)))
            out["logprobs"].append([0.0] * len(carried) + [-0.1] * len(new) + [0.0] * (C - len(ids)))
            out["lengths"].append(len(ids))
            out["finished"].append(bool(new) and new[-1] in eos_ids)
        a = {k: np.asarray(v) for k, v in out.items()}
        return sampler.SampleOutput(a["tokens"], a["lengths"], a["finished"], a["logprobs"], None, None, np.int32(0),
                                    np.ones(len(rows), bool))
    monkeypatch.setattr(sampler, "generate", generate)
    call_path_only(monkeypatch, tool_loop)
    return carried_back


def test_evaluate_with_tools_scores_the_models_own_text(qwen_dir, tiny_set, tmp_path, monkeypatch):
    from sage_jax.tools import registry
    hf = family_tokenizer("qwen2.5")
    carried_back = _scripted_sampler(monkeypatch, hf)
    real_make_tools = registry.make_tools
    monkeypatch.setattr(registry, "make_tools", lambda names, timeout_s=5.0: {**real_make_tools(names, timeout_s),
                                                                             "oracle": Oracle()})
    monkeypatch.setattr(evaluation, "plot_pass_at_k", lambda curves, path, title="": Path(path).write_bytes(b"png"))
    out = tmp_path / "out"
    assert _main(["--model", qwen_dir, "--datasets", tiny_set, "--out", out, *FAST]) == 0
    records = {r["answer"]: r for r in map(json.loads, (out / "arith" / "samples.jsonl").read_text().splitlines())}
    calc, oracle = records["42"], records["5"]
    # the prompt lists the tool in the template's tools block (the hermes format)
    assert '"name": "calculator"' in calc["prompt"]
    # the calculator ran: its output is the tool turn, and the rows came back carrying it as observed tokens
    for r in (calc, oracle):
        assert len(r["turns"]) == 4 and all([t["role"] for t in turns] == ["assistant", "tool", "assistant"]
                                            for turns in r["turns"])
        assert r["tools"] == [{"calls": 1, "errors": 0, "timeouts": 0, "truncations": 0}] * 4
    assert {turns[1]["content"] for turns in calc["turns"]} == {"42"}
    assert {turns[1]["content"] for turns in oracle["turns"]} == {"\\boxed{5}"}
    carried = [hf.decode(ids) for ids in carried_back]
    assert any("<tool_response>\n42\n</tool_response>" in c for c in carried), carried
    # pass@k from the model's own text: the oracle's rows never state the answer, so none is correct
    own = hf.decode(hf.encode(CALC + "The answer is \\boxed{42}."), skip_special_tokens=True)  # as the reward reads
    assert calc["completions"] == [own] * 4 and calc["num_correct"] == 4 and calc["rewards"] == [1.0] * 4
    assert all("boxed{5}" not in c for c in oracle["completions"]) and oracle["num_correct"] == 0
    results = json.loads((out / "arith" / "results.json").read_text())
    assert results["pass_at_k"] == {"1": 0.5, "2": 0.5, "4": 0.5}
    assert results["tools"] == {"calls_per_row": 1.0, "turns": 2.0, "rows_without_calls": 0.0, "errors": 0,
                                "timeouts": 0, "truncations": 0}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["datasets"]["arith"]["tools"]["calls_per_row"] == 1.0
    assert summary["settings"]["tools"] == ["calculator"] and summary["settings"]["tool_format"] == "hermes"
    # a rerun resumes without sampling
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("a finished evaluation loaded the model"))
    assert _main(["--model", qwen_dir, "--datasets", tiny_set, "--out", out, *FAST]) == 0
    assert json.loads((out / "arith" / "results.json").read_text())["tools"] == results["tools"]


def test_bad_tool_input_is_one_line(qwen_dir, tiny_set, tmp_path, capsys):
    base = ["--model", qwen_dir, "--datasets", tiny_set, "--n", "2", "--reward-workers", "0"]
    assert "unknown tool" in _error(capsys, base + ["--tools", "shell", "--out", tmp_path / "a"])
    assert "--max-turns" in _error(capsys, base + ["--tools", "calculator", "--max-turns", "0",
                                                   "--out", tmp_path / "b"])
    smollm = tmp_path / "smollm_tok"
    family_tokenizer("smollm2").save_pretrained(smollm)  # no `</tool_call>` token: the hermes format cannot pause
    err = _error(capsys, base + ["--tools", "calculator", "--tool-format", "hermes", "--tokenizer", smollm,
                                 "--out", tmp_path / "c"])
    assert "--tool-format hermes" in err and "</tool_call>" in err
    out = tmp_path / "d"
    out.mkdir()
    (out / ev.SETTINGS_FILE).write_text(json.dumps({"tools": ["calculator"]}))
    assert "tools was ['calculator'], now None" in _error(capsys, base + ["--out", out])


def _calling_model(path: Path, tok) -> Path:
    """A tiny Qwen2 whose every next token is drawn from one fixed distribution: `</tool_call>` ~1/4, `<|im_end|>`
    ~1/20, the rest uniform (its layers write nothing to the residual stream, every embedding is one vector, and
    the head reads it so). Its calls are random text: each gets an error observation and the row resumes."""
    from safetensors.numpy import load_file, save_file
    tiny_hf_model(path, vocab=len(tok))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
        (path / name).write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    V, D = weights["model.embed_tokens.weight"].shape
    e = np.random.RandomState(0).randn(D).astype(np.float32)
    weights["model.embed_tokens.weight"] = np.tile(e, (V, 1))
    h = e / np.sqrt(np.mean(e ** 2) + 1e-6) * weights["model.norm.weight"]
    head = np.zeros((V, D), np.float32)
    head[tok.convert_tokens_to_ids("</tool_call>")] = np.log(V / 3) * h / (h @ h)
    head[tok.convert_tokens_to_ids("<|im_end|>")] = np.log(V / 20) * h / (h @ h)
    weights["lm_head.weight"] = head
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_evaluate_with_tools_on_the_real_sampler(tiny_set, tmp_path, monkeypatch):
    """The sampler itself (no script): rows stop at `</tool_call>`, leave the pool, and resume with the observation
    prefilled; the same command twice draws the same samples (a row draws as it would have uninterrupted)."""
    tok = family_tokenizer("qwen2.5")
    model = _calling_model(tmp_path / "model", tok)
    tok.save_pretrained(model)
    monkeypatch.setattr(evaluation, "plot_pass_at_k", lambda curves, path, title="": Path(path).write_bytes(b"png"))
    argv = ["--model", model, "--datasets", tiny_set, "--n", "2", "--k", "1,2", "--max-new-tokens", "128",
            "--reward-workers", "0", "--dtype", "float32", "--no-progress", "--template", "plain",
            "--tools", "calculator", "--tool-format", "hermes", "--max-turns", "2", "--limit", "1"]
    runs = []
    for out in (tmp_path / "a", tmp_path / "b"):
        assert _main([*argv, "--out", out]) == 0
        runs.append([json.loads(line) for line in (out / "arith" / "samples.jsonl").read_text().splitlines()])
    assert runs[0] == runs[1]
    record = runs[0][0]
    calls = [t for turns in record["turns"] for t in turns if t["role"] == "tool"]
    assert calls and all(t["content"].startswith("Error: ") for t in calls)  # random text is no call
    made = sum(t["calls"] for t in record["tools"])  # (a call whose answer would not fit the budget ends its row)
    assert made >= len(calls) and made == sum(t["errors"] for t in record["tools"])
    assert all("Error" not in c for c in record["completions"])  # the tool's output is not the model's text
    results = json.loads((tmp_path / "a" / "arith" / "results.json").read_text())
    assert results["tools"]["calls_per_row"] == made / 2 and results["tools"]["errors"] == made


def test_a_training_runs_tools_are_the_default():
    """A workdir's rollout.tools and limits apply unless a flag says otherwise; --tools none turns them off."""
    from sage_jax.eval import tool_eval
    from sage_jax.run import config as config_lib
    run_config = config_lib.load("configs/tiny_test.py", ["--config.rollout.tools=('calculator',)",
                                                          "--config.rollout.tool_format=hermes",
                                                          "--config.rollout.max_turns=2"])
    args = evaluate.parse_args(["--model", "x"])
    assert tool_eval.tool_options(args, run_config) == {
        "tools": ["calculator"], "tool_format": "hermes", "max_turns": 2, "tool_timeout": 5.0, "max_tool_tokens": 512,
        "tool_workers": 8}
    args = evaluate.parse_args(["--model", "x", "--tools", "python", "--tool-format", "markdown", "--max-turns", "3"])
    opts = tool_eval.tool_options(args, run_config)
    assert (opts["tools"], opts["tool_format"], opts["max_turns"]) == (["python"], "markdown", 3)
    assert tool_eval.tool_options(evaluate.parse_args(["--model", "x", "--tools", "none"]), run_config) == {}
    assert tool_eval.tool_options(evaluate.parse_args(["--model", "x"]), None) == {}
