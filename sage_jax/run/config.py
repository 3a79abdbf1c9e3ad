"""Load `configs/NAME.py[:arg]` files (big_vision style) and apply `--config.a.b=value` overrides.

Every config file defines `get_config(arg: str | None) -> ml_collections.ConfigDict`. The result is locked: setting a
key that does not exist is an error naming the key, not a silent new field.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from typing import Any, Callable, Sequence

import ml_collections


class ConfigError(ValueError):
    """A config file or override the user can fix; the message says how."""


def _repo_root_of(config_path: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(config_path)))


def load_file(spec: str) -> ml_collections.ConfigDict:
    """`path/to/config.py` or `path/to/config.py:arg` -> locked ConfigDict."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found (expected e.g. configs/cpu_demo.py)")
    # Config files import their siblings as `from configs import base`.
    root = _repo_root_of(path)
    if root not in sys.path:
        sys.path.insert(0, root)
    module_name = "_sage_config_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"{e.filename or path}:{e.lineno}: syntax error in the config file ({e.msg})") from None
    except Exception as e:  # a failing import or statement at the file's top level
        raise ConfigError(f"{_failing_line(e, path)}: the config file fails to load ({type(e).__name__}: {e})"
                          ) from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config(arg) function")
    _check_arg(module, path, arg)
    try:
        config = module.get_config(arg or None)
    except (ConfigError, KeyError, ValueError) as e:
        raise ConfigError(f"{path}:{arg}: {e}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config must return an ml_collections.ConfigDict")
    config.lock()
    return config


def _failing_line(e: BaseException, path: str) -> str:
    """`file:line` of the innermost traceback frame inside the config file (else its last frame)."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
    frame = (mine or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else path


def _check_arg(module, path: str, arg: str) -> None:
    """A config that names its accepted args (ARGS: a tuple, or a function returning one) rejects any other, so a
    typo such as cpu_demo.py:quikc is an error instead of a silent default."""
    accepted = getattr(module, "ARGS", None)
    if accepted is None or not arg:
        return
    accepted = tuple(accepted() if callable(accepted) else accepted)
    if arg not in accepted:
        raise ConfigError(f"{path}:{arg}: unknown config argument {arg!r}; {os.path.basename(path)} accepts "
                          f"{', '.join(map(repr, accepted)) or 'no argument'}")


def _parse_value(text: str, current: Any, key: str) -> Any:
    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}={text}: expected true or false")
    if isinstance(current, int) and not isinstance(current, bool):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--config.{key}={text}: expected an integer") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--config.{key}={text}: expected a number") from None
    if isinstance(current, (tuple, list)):
        return _parse_tuple(text, tuple(current), key)
    if isinstance(current, str) or current is None:
        return text
    raise ConfigError(f"--config.{key}: cannot set a field of type {type(current).__name__} from the command line")


def _parse_tuple(text: str, current: tuple, key: str) -> tuple:
    """`1,2,4`, `q_proj,v_proj` (bare words are strings) or a Python literal `(1, 2)`; the items must have the type
    of the field's current items, so a typo fails here rather than deep in the run."""
    kinds = {type(x) for x in current}
    kind = kinds.pop() if len(kinds) == 1 else None
    example = ",".join(map(str, current[:2])) or "1,2,4"
    if text.strip().startswith(("(", "[")):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ConfigError(f"--config.{key}={text}: not a valid tuple; write it as {example}") from None
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"--config.{key}={text}: expected a tuple such as {example}")
        items = list(value)
    else:
        items = [_parse_item(part.strip(), kind) for part in text.split(",") if part.strip()]
    bad = [x for x in items if not _item_fits(x, kind)]
    if bad or (text.strip() and not items):
        want = f"{kind.__name__} items" if kind else "items"
        raise ConfigError(f"--config.{key}={text}: expected {want} such as {example} (bad: "
                          f"{', '.join(map(repr, bad)) or repr(text)})")
    return tuple(float(x) if kind is float else x for x in items)


def _item_fits(x: Any, kind: type | None) -> bool:
    if kind is None:  # an empty or mixed tuple: anything goes
        return True
    if isinstance(x, bool) or kind is bool:  # bool is an int subclass: keep the two apart
        return isinstance(x, bool) and kind is bool
    return isinstance(x, (int, float)) if kind is float else isinstance(x, kind)


def _parse_item(text: str, kind: type | None) -> Any:
    """One comma-separated item: a string field's items are taken as written, others as Python literals."""
    if kind is str:
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word; rejected by the type check unless the field holds strings


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> ml_collections.ConfigDict:
    """Apply ["a.b=1", ...] (or "--config.a.b=1") to a locked config; unknown keys are errors."""
    for item in overrides:
        item = item.removeprefix("--").removeprefix("config.")
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --config.key=value")
        node = config
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                where = ".".join(parts[:i]) or "config"
                raise ConfigError(f"unknown config key {key!r}: {where} has no field {part!r} "
                                  f"(known: {', '.join(known)})")
            if i < len(parts) - 1:
                node = node[part]
        leaf = parts[-1]
        value = _parse_value(text, node[leaf], key)
        with node.ignore_type():
            node[leaf] = value
    return config


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    return apply_overrides(load_file(spec), overrides)


def split_config_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate `--config.x=y` overrides from the other flags."""
    overrides, rest = [], []
    for arg in argv:
        (overrides if arg.startswith("--config.") else rest).append(arg)
    return overrides, rest


# ------------------------------------------------------------------------------------------------- validation
# (key, test, what the value must be). Checked before any work, so a bad value fails in a second, not after training.
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("data.task", lambda v: v in ("math", "kk", "countdown"), "one of 'math', 'kk', 'countdown'"),
    ("data.max_prompt_len", lambda v: v >= 1, ">= 1"),
    ("rollout.group_size", lambda v: v >= 2, ">= 2 (group-relative advantages compare rollouts of one prompt; "
                                             "with 1 every advantage is 0)"),
    ("rollout.prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("rollout.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("rollout.temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.top_k", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("rollout.min_p", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("rollout.slots", lambda v: v is None or v in ("auto", "all") or (str(v).isdigit() and int(v) >= 1),
     "an integer >= 1 (decode slots), 'auto' (as many as fit) or 'all' / None (one per row)"),
    ("rollout.decode_attention", lambda v: v in ("auto", "blocked", "one_pass", "kernel"),
     "'auto' (the platform's), 'blocked', 'one_pass' or 'kernel' (sage_jax.models.decode_forms)"),
    ("rollout.partial", lambda v: isinstance(v, bool), "True or False (partial rollouts)"),
    ("rollout.oversample", lambda v: v >= 1, ">= 1 (groups kept in flight per group trained)"),
    ("rollout.max_lag", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (policy versions)"),
    ("rollout.tools", lambda v: set(v) <= {"python", "calculator"}, "a tuple of 'python', 'calculator' (or ())"),
    ("rollout.tool_format", lambda v: v in ("markdown", "hermes"), "'markdown' (```python blocks) or 'hermes' "
                                                                    "(the chat template's <tool_call>)"),
    ("rollout.max_turns", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1 (tool calls per row)"),
    ("rollout.tool_timeout", lambda v: v > 0, "> 0 seconds"),
    ("rollout.max_tool_tokens", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    ("rollout.tool_workers", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1 (tool calls at once)"),
    ("rollout.tool_return_share", lambda v: 0 < v <= 1, "in (0, 1] (the share of a call's groups complete when it "
                                                        "returns)"),
    ("loss.beta", lambda v: v >= 0, ">= 0"),
    ("loss.gamma", lambda v: v >= 0, ">= 0"),
    ("loss.tau", lambda v: v > 0, "> 0"),
    ("loss.eps_low", lambda v: v >= 0, ">= 0"),
    ("loss.eps_high", lambda v: v >= 0, ">= 0"),
    ("loss.tis_cap", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("loss.schedule_cycles", lambda v: v >= 1, ">= 1"),
    ("optim.lr", lambda v: v > 0, "> 0"),
    ("optim.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("optim.schedule", lambda v: v in ("constant", "cosine"), "'constant' or 'cosine'"),
    ("optim.num_iterations", lambda v: v >= 1, ">= 1"),
    ("optim.mini_batches", lambda v: v >= 1, ">= 1"),
    ("optim.grad_accum", lambda v: v >= 1, ">= 1"),
    ("train.steps", lambda v: v >= 1, ">= 1 (the number of RL steps)"),
    ("train.ckpt_every", lambda v: v >= 1, ">= 1 (save a checkpoint every this many steps)"),
    ("train.keep_ckpts", lambda v: v >= 1, ">= 1"),
    ("train.eval_every", lambda v: v >= 0, ">= 0 (0 = only before and after)"),
    ("train.sample_every", lambda v: v >= 0, ">= 0 (0 = never)"),
    ("train.reward_workers", lambda v: v >= 0, ">= 0 (0 = one worker process)"),
    ("train.reward_timeout", lambda v: v > 0, "> 0 seconds"),
    ("train.reward_memory_mb", lambda v: v >= 0, ">= 0 MiB (0 = no cap)"),
    ("train.max_resample", lambda v: v >= 0, ">= 0"),
    ("train.off_policy_steps", lambda v: v >= 0, ">= 0 (0 = on-policy; 1 = the next batch is sampled while this one "
                                                 "trains)"),
    ("mesh.rollout_devices", lambda v: v >= 0, ">= 0 (0 = the sampler shares the training devices)"),
    ("eval.n", lambda v: v >= 1, ">= 1 (samples per problem)"),
    ("eval.problems", lambda v: v >= 0, ">= 0 (0 = all)"),
    ("eval.temperature", lambda v: v >= 0, ">= 0"),
    ("sft.steps", lambda v: v >= 0, ">= 0 (0 = no SFT)"),
    ("sft.ckpt_every", lambda v: v >= 1, ">= 1"),
    ("sft.batch_size", lambda v: v >= 1, ">= 1"),
    ("sft.lr", lambda v: v > 0, "> 0"),
    ("sft.num_demos", lambda v: v >= 1, ">= 1"),
    ("model.lora.targets", lambda v: bool(v) and set(v) <= set(_lora_modules()),
     "HF module names LoRA can adapt (sage_jax.models.lora.MODULES: q_proj, ..., down_proj), e.g. q_proj,v_proj"),
)


def _lora_modules() -> tuple[str, ...]:
    from sage_jax.models import lora  # imports JAX: only when a config is validated, never at flag parsing
    return tuple(lora.MODULES.values())


def _get(config: ml_collections.ConfigDict, key: str) -> tuple[bool, Any]:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Raise ConfigError naming the first bad key and what it must be; keys a config lacks are skipped."""
    for key, ok, must in _RULES:
        present, value = _get(config, key)
        if not present:
            continue
        try:
            good = bool(ok(value))
        except TypeError:
            good = False
        if not good:
            raise ConfigError(f"--config.{key}={value!r}: must be {must}")
    _, partial = _get(config, "rollout.partial")
    if partial:
        _, k = _get(config, "train.off_policy_steps")
        _, lag = _get(config, "rollout.max_lag")
        _, dynamic = _get(config, "train.dynamic_sampling")
        if k and k > 1:
            raise ConfigError(f"--config.rollout.partial=True works with train.off_policy_steps 0 or 1, not {k}: each "
                              "step's call continues the rows the call before it left")
        if k and lag < k:
            raise ConfigError(f"--config.rollout.max_lag={lag}: must be >= train.off_policy_steps={k} (every token "
                              "is that many steps old): no group could be trained")
        if dynamic:
            raise ConfigError("--config.rollout.partial=True does not combine with train.dynamic_sampling=True yet: "
                              "set one of them to False")
    _, tools = _get(config, "rollout.tools")
    if tools and partial:
        raise ConfigError("--config.rollout.tools does not combine with rollout.partial=True yet: set one of them off")
    present, ks = _get(config, "eval.ks")
    _, n = _get(config, "eval.n")
    if present and (not ks or any(not isinstance(k, int) or not 1 <= k <= n for k in ks)):
        raise ConfigError(f"--config.eval.ks={tuple(ks)!r}: every k must be between 1 and eval.n={n} (pass@k needs k "
                          "of the n samples); lower the ks or raise --config.eval.n")
    return config
