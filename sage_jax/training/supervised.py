"""Supervised fine-tuning (cross-entropy on demonstrations): the warm-start before RL.

Demonstrations are countdown solutions (spread unevenly over strategies, so RL starts from a base with a dominant
mode and rarer valid ones), generated products of which sft.tool_share call the Python tool ("tool_traces"), or a
jsonl file of prompt/completion rows.
"""

from __future__ import annotations

import logging as pylogging
import random
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.data import tasks
from sage_jax.models import build, decoder as model_lib, sharding
from sage_jax.run import checkpoint, guard as run_guard, record as run_record
from sage_jax.training import state as train_state
from sage_jax.run import metrics_log as slog
from sage_jax.data import loaders

log = pylogging.getLogger("sage_jax")


def demonstrations(config, task: tasks.Task) -> list[tuple[str, str]]:
    """(prompt text, completion text) pairs."""
    s = config.sft
    if s.data == "countdown":
        from sage_jax.rewards import countdown
        problems = [{"numbers": ex.meta["numbers"], "target": ex.meta["target"]} for ex in task.train]
        rng, demos = random.Random(config.seed), []
        while len(demos) < s.num_demos:  # several passes: a problem's demos differ, drawn by the mode weights
            demos += countdown.demonstrations(problems, rng, dict(s.mode_weights))
        return [(d["prompt"], d["completion"]) for d in demos[:s.num_demos]]
    if s.data == "tool_traces":  # products: a share of the demonstrations call the Python tool (word_problems)
        from sage_jax.data import word_problems
        if any("expression" not in ex.meta for ex in task.train):
            raise ValueError("sft.data='tool_traces' demonstrates the generated products: set data.train=products")
        pairs = word_problems.tool_demonstrations(task.train, float(s.get("tool_share", 0.0)), config.seed)
        return [(task.prompt_text(loaders.Example(p, "")), c) for p, c in pairs]
    pairs = []
    for line, row in loaders.read_jsonl(s.data):
        if s.prompt_field not in row or s.completion_field not in row:
            missing = s.prompt_field if s.prompt_field not in row else s.completion_field
            raise ValueError(f"{s.data}:{line}: row has no field {missing!r} (set sft.prompt_field / "
                             "sft.completion_field)")
        for field in (s.prompt_field, s.completion_field):
            if not isinstance(row[field], str):
                what = "is null" if row[field] is None else f"should be text, got {type(row[field]).__name__}"
                raise ValueError(f"{s.data}:{line}: field {field!r} {what}; give the row its text or drop the row")
        pairs.append((task.prompt_text(loaders.Example(row[s.prompt_field], "")), row[s.completion_field]))
    if not pairs:
        raise ValueError(f"{s.data}: no demonstrations in it (an empty file?); give it one JSON object per line "
                         f"with fields {s.prompt_field!r} and {s.completion_field!r}")
    return pairs


class SFTData(NamedTuple):
    """The demonstrations as trained: right-padded [N, T] tokens, attention mask, loss mask on completion tokens."""
    tokens: np.ndarray
    mask: np.ndarray
    loss_mask: np.ndarray
    left_out: int                        # demonstrations with no completion token within the length limit
    cut: int                             # kept ones whose completion is cut at the limit
    max_len: int                         # data.max_prompt_len + rollout.max_new_tokens


def prepare(config, task: tasks.Task) -> SFTData:
    """config.sft's demonstrations, checked and tokenized (a ValueError names the file and line of a bad row)."""
    max_len = config.data.max_prompt_len + config.rollout.max_new_tokens
    return tokenize(task, demonstrations(config, task), max_len, source=config.sft.data)


def tokenize(task: tasks.Task, pairs, max_len: int, source: str = "") -> SFTData:
    """The pairs cut at max_len tokens; a pair whose prompt leaves no completion token is left out (it would train on
    nothing) and counted; ValueError if none is left."""
    rows, loss_rows, cut, longest = [], [], 0, 0
    eos = task.tokenizer.eos_ids[0]
    for prompt, completion in pairs:
        p = tasks.encode_prompt_text(task.tokenizer, task.template, prompt)
        c = list(task.tokenizer.encode_completion(completion)) if hasattr(task.tokenizer, "encode_completion") \
            else list(task.tokenizer.encode(completion)) + [eos]
        longest = max(longest, len(p))
        if len(p) >= max_len:
            continue
        cut += len(p) + len(c) > max_len
        rows.append((p + c)[:max_len])
        loss_rows.append(([0] * len(p) + [1] * len(c))[:max_len])
    if not rows:
        raise ValueError(f"{source or 'SFT data'}: every one of its {len(pairs)} demonstrations has a prompt of at "
                         f"least {max_len} tokens (the longest {longest}), the SFT length limit (data.max_prompt_len"
                         " + rollout.max_new_tokens): no completion token is left to train on; raise "
                         "--config.data.max_prompt_len")
    T = max(len(r) for r in rows)
    tokens = np.full((len(rows), T), task.tokenizer.pad_id, np.int32)
    mask = np.zeros((len(rows), T), np.int32)
    loss_mask = np.zeros((len(rows), T), np.float32)
    for i, (r, lm) in enumerate(zip(rows, loss_rows)):
        tokens[i, :len(r)], mask[i, :len(r)], loss_mask[i, :len(lm)] = r, 1, lm
    return SFTData(tokens, mask, loss_mask, len(pairs) - len(rows), cut, max_len)


def _warn_left_out(data: SFTData, source: str) -> None:
    if data.left_out:
        log.warning("%d of %d SFT demonstrations in %s have a prompt of %d tokens or more, the SFT length limit "
                    "(data.max_prompt_len + rollout.max_new_tokens): no completion token is left, so they are left "
                    "out; raise data.max_prompt_len to train on them", data.left_out,
                    data.left_out + len(data.tokens), source, data.max_len)
    if data.cut:
        log.warning("%d of %d SFT demonstrations in %s are cut at %d tokens (data.max_prompt_len + "
                    "rollout.max_new_tokens): their completions train on the first tokens only", data.cut,
                    data.left_out + len(data.tokens), source, data.max_len)


def sft_loss(params, batch, cfg):
    """Mean cross-entropy over completion tokens (position t predicts token t+1)."""
    tokens, mask, loss_mask = batch["tokens"], batch["mask"], batch["loss_mask"]
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    weights = jnp.concatenate([loss_mask[:, 1:], jnp.zeros_like(loss_mask[:, :1])], axis=1)
    logp, _ = model_lib.logprobs_and_entropy(cfg, params, tokens, targets, mask_BxT=mask)
    loss = -(logp * weights).sum() / jnp.maximum(weights.sum(), 1.0)
    return loss, {"sft/loss": loss}


def run_sft(config, workdir: str, task: tasks.Task | None = None, data: SFTData | None = None):
    """Train config.sft.steps steps on `task`'s demonstrations (default tasks.build(config); `data`: them prepared
    already), resumable from workdir; returns (cfg, the fine-tuned params on the mesh)."""
    s = config.sft
    rules = dict(config.mesh.rules)
    mesh = sharding.make_mesh(tuple(config.mesh.shape))
    task = task or tasks.build(config)
    data = data or prepare(config, task)  # a bad row stops the run before the model loads
    with jax.set_mesh(mesh), sharding.use_rules(rules), run_guard.locked(workdir):
        ckpt = checkpoint.Checkpointer(workdir, keep=2)  # the newest may not be proven finite yet
        if (ckpt.latest_step() or 0) < s.steps:  # a finished SFT trains no more: its settings no longer matter
            run_record.check_resume(config, ckpt, workdir, sft=True)
        _warn_left_out(data, s.data)
        cfg, params = build.load_or_init_params(config, mesh, rules, task.tokenizer)
        tokens, mask, loss_mask = data.tokens, data.mask, data.loss_mask
        optim = config.optim.copy_and_resolve_references()
        with optim.unlocked():
            optim.lr, optim.warmup_steps, optim.schedule, optim.weight_decay = s.lr, s.warmup_steps, "cosine", 0.0
        tx, schedule = train_state.make_optimizer(optim, s.steps)
        state, shardings = train_state.create_state(params, tx, cfg, mesh, rules)
        del params
        step_fn = train_state.make_train_step(cfg, None, tx, schedule, config.seed, 1, shardings,
                                              loss_fn=lambda p, b, c, _l, _s, _k: sft_loss(p, b, c))
        ckpt.check_model(checkpoint.model_meta(cfg))
        restored = ckpt.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                             state))
        start = 0
        if restored is not None:
            start, state, _ = restored
            log.info("SFT resumed at step %d from %s", start, workdir)
        watch = checkpoint.FiniteWatch(ckpt, start if restored is not None else None)
        logger = slog.MetricsLogger(workdir, use_tensorboard=config.train.use_tensorboard, resume_step=start)
        progress = slog.Progress(total=s.steps, initial=start, enabled=config.train.progress, desc="sft")
        rng = np.random.default_rng(config.seed)
        n = tokens.shape[0]
        order = np.concatenate([rng.permutation(n) for _ in range(-(-s.steps * s.batch_size // n) + 1)])
        every = s.get("ckpt_every", s.steps) or s.steps
        t0 = time.perf_counter()
        meta = lambda done: {"sft_step": done, "model": checkpoint.model_meta(cfg),
                             "config": run_record.as_record(config)}
        stop = run_guard.StepStop("SFT step", ckpt, lambda done: ckpt.save(done, state, meta(done)),
                                  closers=(progress, logger))  # on SIGTERM / SIGINT
        for step in stop.steps(start, s.steps):
            rows = order[step * s.batch_size:(step + 1) * s.batch_size]
            put = lambda a: jax.device_put(a, sharding.data_sharding(mesh, a.ndim))
            batch = {"tokens": put(tokens[rows]), "mask": put(mask[rows]), "loss_mask": put(loss_mask[rows]),
                     "rl_step": jnp.asarray(step, jnp.int32)}
            state, metrics = step_fn(state, batch)
            done = step + 1
            # fetched at every save and at the step after it (which proves the saved params give a finite loss)
            if done % 20 == 0 or done % every in (0, 1) or done == s.steps:
                values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                watch.check(step, {**values, "loss/sft": values["sft/loss"]})
                logger.log(step, values)
                progress.update(done, {"sft/loss": values["sft/loss"]})
            if done % every == 0 or done == s.steps:
                ckpt.save(done, state, meta(done))
                watch.saved(done)
        progress.close()
        ckpt.wait()
        if start < s.steps:
            log.info("SFT: %d steps in %.1fs", s.steps - start, time.perf_counter() - t0)
        ckpt.close()
        logger.close()
        return cfg, state["params"]
