"""Tool-integrated rollouts on a tiny random model: rows pause at a call-end token, the call runs in the tool pool
while other rows decode, and the row comes back with the output as observed tokens (NaN behaviour log-probs, never
in the sampled mask); malformed calls get an error observation; max_turns and the token budget hold."""

import threading
import time

import jax
import numpy as np
import pytest

from sage_jax.sampling import sampler
from sage_jax.tools.base import ToolOutput, ToolPool
from sage_jax.tools.calls import ToolCall
from sage_jax.training import tool_rollouts as tr
from tests.sampling.test_sampler import CFG, PROMPTS, _random_params

END_IDS = (3, 17, 40, 44)  # "call ends" the random model writes often
EOS = 63
OBSERVED = [50, 51, 52]


class StubFormat:
    """Calls at END_IDS; 44 ends no call (as a fence that opens a block: the row draws on past it); a turn holding
    token 7 is malformed; every output is observed as OBSERVED + one id (54 for an error)."""
    end_ids, call_format = END_IDS, "markdown"

    def find(self, turn_ids):
        if turn_ids[-1] == 44:
            return None
        return ToolCall(None, None, "bad call") if 7 in turn_ids else ToolCall("slow", {"n": len(turn_ids)})

    def turn_text(self, turn_ids):
        return " ".join(map(str, turn_ids))

    def observe(self, messages, output, max_tokens):
        return OBSERVED + [54 if output.startswith("Error") else 53], False


class SlowTool:
    name, schema = "slow", {}

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()

    def parse(self, arguments):
        return arguments

    def execute(self, payload):
        start = time.perf_counter()
        time.sleep(0.3)
        with self.lock:
            self.spans.append((start, time.perf_counter()))
        return ToolOutput("ok", seconds=0.3)


@pytest.mark.slow  # ~100 s on 2 shared cores: a handful of sampler programs compiled
def test_rows_pause_at_calls_and_resume_with_observed_tokens():
    params = _random_params(CFG)
    key = jax.random.key(3)
    call_starts = []

    def generate_fn(prompts, G, resume, stop, limits, extra_eos):
        call_starts.append(time.perf_counter())
        out = sampler.generate(CFG, params, prompts, max_new_tokens=40, temperature=1.0, eos_ids=(EOS, *extra_eos),
                               seed=key, num_samples=G, resume=resume, stop_after_groups=stop,
                               row_max_new_tokens=limits, slots=4, min_rows=len(PROMPTS) * 2 + 1)
        return type(out)(**{k: (np.asarray(v) if v is not None else v) for k, v in out._asdict().items()})

    tool = SlowTool()
    settings = tr.ToolSettings(max_turns=2, max_tool_tokens=16, return_share=0.25)
    with ToolPool({"slow": tool}, num_workers=4) as pool:
        ro = tr.generate_with_tools(generate_fn, PROMPTS, 2, StubFormat(), pool, settings, 40, key)
    N = len(PROMPTS) * 2
    assert ro["tokens"].shape == (N, 40) and ro["sampled_mask"].shape == (N, 40)
    calls = 0
    for n in range(N):
        L = ro["lengths"][n]
        toks, mask, lp = ro["tokens"][n, :L], ro["sampled_mask"][n, :L], ro["sampler_logp"][n, :L]
        assert np.isnan(lp[mask == 0]).all() and np.isfinite(lp[mask == 1]).all()
        assert (ro["sampled_mask"][n, L:] == 0).all()
        # observed segments are exactly the observations, each right after a sampled call-end token
        starts = [j for j in range(1, L) if mask[j] == 0 and mask[j - 1] == 1]
        for j in starts:
            assert toks[j - 1] in (3, 17, 40) and list(toks[j:j + 3]) == OBSERVED and toks[j + 3] in (53, 54)
        assert all(mask[j + 1] for j in range(L - 1) if toks[j] == 44 and mask[j])  # no observation after a 44
        assert (mask == 0).sum() == 4 * len(starts) and len(starts) <= settings.max_turns
        calls += len(starts)
        if ro["finished"][n]:
            assert toks[-1] == EOS
    assert calls >= 3, "the random model made too few calls for the test to mean anything"
    assert any(44 in ro["tokens"][n, :ro["lengths"][n] - 1] for n in range(N)), "no false stop was drawn past"
    stats = ro["tool_stats"]
    assert stats["tools/calls_per_row"] * N >= calls and stats["tools/sampler_calls"] >= 1
    # the pool kept decoding while tools ran: a sampler call started inside some tool's run
    assert any(a < t < b for t in call_starts[1:] for a, b in tool.spans)


def test_markdown_format_stops_only_at_tokens_closing_a_fence():
    from tests.helpers_chat_templates import family_tokenizer
    hf = family_tokenizer("smollm2")
    fmt = tr.ToolFormat(hf, "markdown", {})
    assert fmt.end_ids and all(tr._closes_fence(hf.decode([i])) for i in fmt.end_ids)
    assert tr._closes_fence("```\n") and tr._closes_fence(" ```\n\n") and tr._closes_fence("```")
    assert not tr._closes_fence("```python") and not tr._closes_fence("``")
    ids, clipped = fmt.observe([{"role": "assistant", "content": "```python\nprint(42)\n```\n"}], "42\n", 16)
    assert hf.decode(ids) == "```output\n42\n```\n" and not clipped and ids[-1] not in fmt.end_ids


def test_hermes_format_needs_a_single_call_end_token():
    from tests.helpers_chat_templates import family_tokenizer
    from sage_jax.tools.calculator import Calculator
    fmt = tr.ToolFormat(family_tokenizer("qwen2.5"), "hermes", {"calculator": Calculator()})
    assert len(fmt.end_ids) == 1
    with pytest.raises(ValueError, match="</tool_call>"):
        tr.ToolFormat(family_tokenizer("smollm2"), "hermes", {})
    with pytest.raises(ValueError, match="max_turns"):
        tr.ToolSettings(max_turns=0)


class ScriptedGenerate:
    """sampler.generate's interface over scripted rows (no model): each row writes its script's tokens in order,
    stopping at a stop id; resumed rows carry their ids in (checked) and go on where their script left off."""

    def __init__(self, script_ids, pad_id=0):
        self.script, self.pad, self.cursor = list(script_ids), pad_id, {}

    def __call__(self, prompts, G, resume, stop, limits, extra_eos, C=64):
        eos = {self.eos, *extra_eos}
        fresh = [(p, b * G + g, []) for b, p in enumerate(prompts) for g in range(G)]
        rows = fresh + [(list(r.prompt), r.row_id, list(r.tokens)) for r in resume]
        out = {k: [] for k in ("tokens", "logprobs", "lengths", "finished", "done")}
        for i, (prompt, row_id, carried) in enumerate(rows):
            key = "throwaway" if i < len(fresh) and limits is not None else row_id  # the resume calls' extra row
            budget = (limits[i] if limits is not None and i < len(fresh) else
                      resume[i - len(fresh)].max_new_tokens if i >= len(fresh) else C) or C
            new, at = [], self.cursor.get(key, 0)
            while len(carried) + len(new) < budget and at < len(self.script):
                new.append(self.script[at])
                at += 1
                if new[-1] in eos:
                    break
            self.cursor[key] = at
            ids = carried + new
            out["tokens"].append(ids + [self.pad] * (C - len(ids)))
            out["logprobs"].append([0.0] * len(carried) + [-0.1] * len(new) + [0.0] * (C - len(ids)))
            out["lengths"].append(len(ids))
            out["finished"].append(bool(new) and new[-1] in eos)
            out["done"].append(True)
        arrays = {k: np.asarray(v) for k, v in out.items()}
        return sampler.SampleOutput(arrays["tokens"], arrays["lengths"], arrays["finished"], arrays["logprobs"],
                                    None, None, np.int32(0), arrays["done"])


def _scripted(hf, script_text, eos_token):
    gen = ScriptedGenerate(hf.encode(script_text, add_special_tokens=False) + [hf.convert_tokens_to_ids(eos_token)])
    gen.eos = hf.convert_tokens_to_ids(eos_token)
    return gen


def test_hermes_rollout_matches_the_chat_template_end_to_end():
    """A scripted model calls the calculator through Qwen2.5's template: the row is the template's own tokens."""
    from tests.helpers_chat_templates import family_tokenizer
    from sage_jax.tools.calculator import Calculator
    hf = family_tokenizer("qwen2.5")
    tools = {"calculator": Calculator()}
    fmt = tr.ToolFormat(hf, "hermes", tools)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    gen = _scripted(hf, call + "The answer is 42.", "<|im_end|>")
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    schemas = [t.schema for t in tools.values()]
    prompt = list(hf.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, return_dict=False))
    with ToolPool(tools) as pool:
        ro = tr.generate_with_tools(gen, [prompt], 1, fmt, pool, tr.ToolSettings(), 64, 0)
    L = ro["lengths"][0]
    full = messages + [{"role": "assistant", "content": call}, {"role": "tool", "content": "42"},
                       {"role": "assistant", "content": "The answer is 42."}]
    want = list(hf.apply_chat_template(full, tools=schemas, return_dict=False))
    assert want[:len(prompt) + L] == prompt + list(ro["tokens"][0, :L])
    assert ro["finished"][0] and ro["tool_stats"]["tools/calls_per_row"] == 1.0
    sampled = ro["tokens"][0, :L][ro["sampled_mask"][0, :L] == 1]
    assert hf.decode(list(sampled), skip_special_tokens=False) == call + "The answer is 42.<|im_end|>"


def test_markdown_rollout_runs_python_in_the_sandbox():
    from tests.helpers_chat_templates import family_tokenizer
    from sage_jax.tools import sandbox
    from sage_jax.tools.python_tool import PythonTool
    if sandbox.available_isolation() is None:
        pytest.skip("namespaces need root with unshare/mount/prlimit/setpriv")
    hf = family_tokenizer("smollm2")
    tools = {"python": PythonTool(timeout_s=5.0)}
    fmt = tr.ToolFormat(hf, "markdown", tools)
    text = "Compute it.\n```python\nprint(6 * 7)\n```\nSo it is 42."
    gen = _scripted(hf, text, "<|im_end|>")
    with ToolPool(tools) as pool:
        ro = tr.generate_with_tools(gen, [[1, 2, 3]], 1, fmt, pool, tr.ToolSettings(), 64, 0)
    L = ro["lengths"][0]
    ids, mask = list(ro["tokens"][0, :L]), ro["sampled_mask"][0, :L]
    assert hf.decode(ids, skip_special_tokens=False) == (
        "Compute it.\n```python\nprint(6 * 7)\n```\n```output\n42\n```\n\nSo it is 42.<|im_end|>")
    assert hf.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == text + "<|im_end|>"
    assert np.isnan(ro["sampler_logp"][0, :L][mask == 0]).all()


def call_path_only(monkeypatch, module) -> None:
    """module.bind_sampler without its pool session: scripted rows stand in for sampler.generate, which only the
    call path calls (a pool session runs the model itself)."""
    real_bind = module.bind_sampler

    def bind(*args, **kwargs):
        fn = real_bind(*args, **kwargs)
        del fn.session
        return fn
    monkeypatch.setattr(module, "bind_sampler", bind)


def test_rollout_with_tools_feeds_the_loss_batch_and_the_samples(monkeypatch):
    """rollouts.rollout_phases with rollout.tools: the sampler (scripted here) bound in, the rows' sampled mask and
    NaN log-probs through build_batch, the reward text the model's own, each turn in samples.jsonl."""
    import types
    import ml_collections
    from sage_jax.data.tokenizer import Tokenizer
    from sage_jax.training import rollouts
    from tests.helpers_chat_templates import family_tokenizer
    hf = family_tokenizer("qwen2.5")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    gen = _scripted(hf, call + "The answer is 42.", "<|im_end|>")
    monkeypatch.setattr(sampler, "generate", lambda cfg, params, prompts, **kw: gen(
        prompts, kw["num_samples"], kw["resume"], kw["stop_after_groups"], kw["row_max_new_tokens"], kw["eos_ids"]))
    call_path_only(monkeypatch, tr)
    task = types.SimpleNamespace(tokenizer=Tokenizer(hf), gold=lambda ex: "42", prompt_text=lambda ex: ex,
                                 encode_prompt=lambda ex: hf.encode(ex, add_special_tokens=False))
    cfg = types.SimpleNamespace(eos_token_ids=(gen.eos,), pad_token_id=0)
    ro_cfg = ml_collections.ConfigDict(dict(group_size=2, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=0,
                                            min_p=0.0, tools=("calculator",), tool_format="hermes", max_turns=2))
    ro = rollouts.rollout(task, cfg, None, ["What is 6 * 7?"], ro_cfg, 0, 64)
    assert ro["texts"] == [hf.decode(hf.encode(call + "The answer is 42."), skip_special_tokens=True)] * 2
    assert ro["tool_stats"]["tools/calls_per_row"] == 1.0 and ro["tool_stats"]["tools/errors"] == 0.0
    assert ro["tool_stats"]["tools/seconds"] >= 0.0
    batch = rollouts.build_batch(ro, np.zeros(2, np.float32), pad_id=0, max_new_tokens=64)
    observed = (batch["completion_mask"] > 0) & (batch["sampled_mask"] == 0)
    assert observed.sum() > 0 and np.isnan(batch["sampler_logp"][observed]).all()
    ro["rewards"] = np.ones(2, np.float32)
    sample = rollouts.samples(ro, 1)[0]
    assert [t["role"] for t in sample["turns"]] == ["assistant", "tool", "assistant"]
    assert sample["turns"][1]["content"] == "42"


def test_config_rules_for_tools():
    from sage_jax.run import config as config_lib
    config = config_lib.load("configs/cpu_demo.py", [])
    config.rollout.tools = ("python", "shell")
    with pytest.raises(config_lib.ConfigError, match="rollout.tools"):
        config_lib.validate(config)
    config.rollout.tools, config.rollout.partial = ("python",), True
    with pytest.raises(config_lib.ConfigError, match="rollout.partial"):
        config_lib.validate(config)
    config.rollout.partial, config.rollout.tool_return_share = False, 0.0
    with pytest.raises(config_lib.ConfigError, match="rollout.tool_return_share"):
        config_lib.validate(config)
    config.rollout.tool_return_share = 0.5
    assert tr.settings_from(config.rollout).return_share == 0.5
    assert tr.settings_from(config_lib.load("configs/cpu_demo.py", []).rollout).return_share == 1.0


@pytest.mark.slow  # ~30 s on 2 shared cores: the train step's compile
def test_a_train_step_over_observed_tokens_ignores_their_values():
    """The jitted train step (two micro-batches, token-mean): rows with observed tokens (NaN behaviour log-probs)
    update the weights exactly as when those tokens' behaviour and reference log-probs are other numbers."""
    import jax.numpy as jnp
    from sage_jax.rl import objectives
    from sage_jax.run import config as config_lib
    from sage_jax.training import state as train_state
    from sage_jax.models import build, decoder
    config = config_lib.load("configs/tiny_test.py", ["--config.loss.aggregation=token-mean",
                                                      "--config.loss.tis_cap=2.0"])
    cfg = build.model_config(config, vocab_size=23)
    params = decoder.init_params(cfg, jax.random.key(0))
    tx, schedule = train_state.make_optimizer(config.optim, 10)
    loss_cfg = objectives.LossConfig.from_config(config.loss, total_steps=10)
    step = train_state.make_train_step(cfg, loss_cfg, tx, schedule, seed=0, grad_accum=2)
    rng = np.random.RandomState(0)
    N, P, C = 4, 4, 8
    tokens = rng.randint(3, 23, (N, P + C)).astype(np.int32)
    sampled = np.ones((N, C), np.float32)
    sampled[0, 2:5] = sampled[2, 1:3] = 0
    base = {"tokens": tokens, "mask": np.ones((N, P + C), np.int32), "completion_mask": np.ones((N, C), np.float32),
            "sampled_mask": sampled, "advantages": rng.randn(N).astype(np.float32),
            "truncated": np.zeros(N, bool), "rl_step": np.int32(0)}
    updates = []
    for fill in (np.nan, -1.5):
        lp = np.where(sampled > 0, -2.5, fill).astype(np.float32)
        ref = np.where(sampled > 0, -2.2, -7.0 if np.isnan(fill) else 0.3).astype(np.float32)
        batch = objectives.with_batch_normaliser({**base, "sampler_logp": lp, "ref_logp": ref}, loss_cfg)
        state = train_state.init_state(jax.tree.map(jnp.copy, params), tx)
        state, metrics = step(state, jax.tree.map(jnp.asarray, batch))
        assert np.isfinite(float(metrics["loss/total"]))
        updates.append(jax.tree.map(np.asarray, state["params"]))
    for a, b in zip(jax.tree.leaves(updates[0]), jax.tree.leaves(updates[1])):
        np.testing.assert_array_equal(a, b)


def test_hermes_prompts_list_the_tools_in_the_chat_template(tmp_path):
    from sage_jax.data import tasks
    from sage_jax.run import config as config_lib
    from tests.helpers_chat_templates import family_tokenizer
    family_tokenizer("qwen2.5").save_pretrained(tmp_path)
    flags = ["--config.data.task=math", "--config.data.train=arith_words", "--config.data.eval=",
             f"--config.tokenizer_path={tmp_path}", "--config.rollout.tools=('calculator',)"]
    hermes = tasks.build(config_lib.load("configs/tiny_test.py", flags + ["--config.rollout.tool_format=hermes"]))
    markdown = tasks.build(config_lib.load("configs/tiny_test.py", flags))
    example = hermes.train[0]
    assert '"name": "calculator"' in hermes.prompt_text(example) and "<tools>" in hermes.prompt_text(example)
    assert "<tools>" not in markdown.prompt_text(example)
