"""Partial rollouts (rollout.partial): the step never waits for its longest row; unfinished rows carry into the next.

Each RL step's sampler call is given the rows carried from earlier calls and enough fresh prompts to hold about
rollout.oversample x B groups in flight, and returns once B groups are complete (sampler.generate's
stop_after_groups). Those B groups -- the oldest complete ones -- are the step's batch, every group whole; the rows
still running leave the pool with their tokens and behaviour log-probs so far (sampling/rows.py: Resumed), and the
next call prefills prompt + tokens so far with its own (newer) weights and decodes on from there. Their finished
siblings wait on the host. A multi-turn row (leave at a tool call, append the tool's answer, come back) is to take
the same path: `Carry` holds rows that left the pool, whatever they left for.

Off-policy bookkeeping: every completion token keeps the log-prob of the policy that drew it and that policy's
version (the RL step whose parameters sampled it); the trainer's importance ratio divides by the recorded log-prob
(as with train.off_policy_steps). A group whose first token is more than rollout.max_lag versions older than the
step that would train it is dropped, never trained on, and counted (rl/dropped_groups).

The cache of a carried row is recomputed with the weights of the call that continues it (its prefill), not kept:
the tokens it draws after coming back are then drawn from exactly the current policy given its prefix, and the
log-probs recorded for them are those of that policy (docs/PERFORMANCE.md, "Partial rollouts": the prefill's cost).

Checkpoints: `Carry` is host data (identical on every process). At each checkpoint the trainer writes the carry each
step it may resume at starts from (WORKDIR/partial/carry_<step>.npz, through run/paths.py like the rest of the
workdir); a resumed run reads it, so it trains on what the uninterrupted run would have.
"""

from __future__ import annotations

import io
import json
import logging as pylogging
import math
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from sage_jax.models import sharding
from sage_jax.rl import objectives
from sage_jax.run import paths
from sage_jax.sampling import sampler
from sage_jax.sampling.rows import Resumed
from sage_jax.training import rollouts

log = pylogging.getLogger("sage_jax")


class Row:
    """One completion on the host: its prompt, tokens so far, their behaviour log-probs and the policy versions that
    drew them; where it stands (done: stopped by EOS or its budget; finished: by EOS); and what it resumes with."""
    __slots__ = ("prompt", "tokens", "logp", "versions", "done", "finished", "key", "row_id", "limit")

    def __init__(self, prompt, tokens, logp, versions, done, finished, key, row_id, limit):
        self.prompt, self.tokens, self.logp, self.versions = list(map(int, prompt)), tokens, logp, versions
        self.done, self.finished, self.key, self.row_id, self.limit = bool(done), bool(finished), key, row_id, limit


class Group:
    """A prompt's G rows, labelled (the RL step whose call started it, its prompt's index in that call); `example`
    is its training example's index in the task's stream (task.train_batch(example, 1, seed))."""
    __slots__ = ("label", "example", "rows", "version")

    def __init__(self, label: tuple[int, int], example: int, rows: list[Row], version: int):
        self.label, self.example, self.rows, self.version = label, example, rows, version

    @property
    def complete(self) -> bool:
        return all(r.done for r in self.rows)

    @property
    def first_version(self) -> int:
        """The version of the policy that drew the group's first token (its call's, when it has none yet)."""
        return min((int(r.versions.min()) for r in self.rows if len(r.versions)), default=self.version)


class Carry:
    """The groups in flight between steps (rows carried, finished siblings waiting, complete groups not yet trained)
    and the position in the task's example stream; snapshots of it as each collect began, for checkpoints."""

    def __init__(self, workdir: str | None = None, k: int = 0):
        self.groups: dict[tuple[int, int], Group] = {}
        self.cursor = 0  # the next fresh example's index in the stream
        self.next_step: int | None = None  # the collect step this state feeds (None: not yet read)
        self.snapshots: dict[int, bytes] = {}
        self.dir = os.path.join(workdir, "partial") if workdir else None
        self.k = k  # train.off_policy_steps: a checkpoint at step s may resume at s .. s + k

    # ---------------------------------------------------------------------------------------- state <-> bytes
    def to_bytes(self) -> bytes:
        meta, arrays = {"cursor": self.cursor, "next_step": self.next_step, "groups": []}, {}
        i = 0
        for g in self.groups.values():
            rows = []
            for r in g.rows:
                arrays.update({f"t{i}": r.tokens, f"l{i}": r.logp, f"v{i}": r.versions, f"k{i}": r.key})
                rows.append(dict(prompt=r.prompt, done=r.done, finished=r.finished, row_id=r.row_id, limit=r.limit))
                i += 1
            meta["groups"].append(dict(label=list(g.label), example=g.example, version=g.version, rows=rows))
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.array(json.dumps(meta)), **arrays)
        return buf.getvalue()

    def load_bytes(self, data: bytes) -> None:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(str(z["__meta__"]))
            arrays = {k: z[k] for k in z.files}
        self.cursor, self.next_step, self.groups, i = int(meta["cursor"]), meta["next_step"], {}, 0
        for g in meta["groups"]:
            rows = []
            for r in g["rows"]:
                rows.append(Row(r["prompt"], arrays[f"t{i}"], arrays[f"l{i}"], arrays[f"v{i}"], r["done"],
                                r["finished"], arrays[f"k{i}"], int(r["row_id"]), int(r["limit"])))
                i += 1
            label = tuple(g["label"])
            self.groups[label] = Group(label, int(g["example"]), rows, int(g["version"]))

    # ---------------------------------------------------------------------------------------- checkpoints
    def _path(self, step: int) -> str:
        return os.path.join(self.dir, f"carry_{step}.npz")

    def begin(self, step: int, fallback_cursor: int) -> None:
        """Make the state the one collect(step) starts from: the one in memory when it feeds `step`, else (a
        resumed run) WORKDIR/partial/carry_<step>.npz, else (step 0, or a workdir without one) an empty carry."""
        if self.next_step != step:
            if self.dir is not None and paths.exists_agreed(self._path(step)):
                try:
                    self.load_bytes(paths.read_bytes(self._path(step)))
                except (OSError, ValueError, KeyError) as e:
                    raise ValueError(f"{self._path(step)} is unreadable ({e}); delete it (and restart from the "
                                     "checkpoint before) or restore it") from None
            else:
                if step > 0:
                    log.warning("no saved partial-rollout carry for RL step %d: starting with no rows in flight "
                                "(the data stream goes on at example %d)", step, fallback_cursor)
                self.groups, self.cursor = {}, fallback_cursor
            self.next_step = step
        self.snapshots[step] = self.to_bytes()
        for old in [s for s in self.snapshots if s < step - 4]:
            del self.snapshots[old]

    def save(self, step: int, keep: Sequence[int] = ()) -> None:
        """At the checkpoint of `step` (after the off-policy pipeline saved its batches): the carry of every step
        step .. step + k it may resume at (collect(s) starts from snapshot s; the present state feeds next_step)."""
        if self.dir is None or jax.process_index() != 0:
            return
        k = self.k
        paths.makedirs(self.dir)
        states = {s: b for s, b in self.snapshots.items() if step <= s <= step + k}
        if self.next_step is not None and step <= self.next_step <= step + k:
            states[self.next_step] = self.to_bytes()
        for s, data in states.items():
            paths.write_bytes(self._path(s), data)
        needed = {c + i for c in (*keep, step) for i in range(k + 1)}
        for name in paths.listdir(self.dir):
            if name.startswith("carry_") and name.endswith(".npz") and int(name[6:-4]) not in needed:
                paths.remove(os.path.join(self.dir, name))

    def report(self) -> str:
        rows = [r for g in self.groups.values() for r in g.rows]
        return (f"{len(self.groups)} groups, {len(rows)} rows ({sum(not r.done for r in rows)} unfinished), the data "
                f"stream at example {self.cursor}")

    # ---------------------------------------------------------------------------------------- one step
    def plan(self, step: int, batch_groups: int, oversample: float, max_lag: int) -> tuple[int, int, int]:
        """Drop the groups too old to train at `step`; -> (groups dropped, groups still needed complete, fresh
        prompts to add)."""
        old = [label for label, g in self.groups.items() if step - g.first_version > max_lag]
        for label in old:
            del self.groups[label]
        complete = sum(g.complete for g in self.groups.values())
        need = max(0, batch_groups - complete)
        target = max(batch_groups, math.ceil(oversample * batch_groups))
        fresh = max(0, target - len(self.groups)) if need else 0
        return len(old), need, fresh

    def resumed(self) -> tuple[list[Resumed], list[Row]]:
        """The rows to continue (every unfinished row of an incomplete group), as the sampler takes them."""
        back, rows, keys = [], [], {}
        for g in self.groups.values():
            for r in g.rows:
                if not r.done:
                    data = np.asarray(r.key, np.uint32)
                    if data.tobytes() not in keys:  # one typed key per call that started rows
                        keys[data.tobytes()] = jax.random.wrap_key_data(data)
                    back.append(Resumed(r.prompt, r.tokens, r.logp, key=keys[data.tobytes()], row_id=r.row_id,
                                        max_new_tokens=r.limit, group=g.label))
                    rows.append(r)
        return back, rows

    def absorb(self, out, step: int, version: int, prompts: list, examples: list[int], G: int, key_data: np.ndarray,
               limits: Sequence[int], carried: list[Row]) -> int:
        """Take a sampler call's rows (host arrays; fresh rows of `prompts` first, then `carried` in order) into the
        carry; -> the new tokens drawn."""
        tokens, logp, lengths = np.asarray(out.tokens), np.asarray(out.logprobs), np.asarray(out.lengths)
        done, finished = np.asarray(out.done), np.asarray(out.finished)
        drawn = 0
        for b, prompt in enumerate(prompts):
            rows = []
            for g in range(G):
                n = b * G + g
                L = int(lengths[n])
                rows.append(Row(prompt, tokens[n, :L].copy(), logp[n, :L].copy(), np.full(L, version, np.int32),
                                done[n], finished[n], key_data, n, int(limits[n])))
                drawn += L
            self.groups[(step, b)] = Group((step, b), examples[b], rows, version)
        for i, r in enumerate(carried):
            n, L, j0 = len(prompts) * G + i, int(lengths[len(prompts) * G + i]), len(r.tokens)
            r.versions = np.concatenate([r.versions, np.full(L - j0, version, np.int32)])
            r.tokens, r.logp = tokens[n, :L].copy(), logp[n, :L].copy()
            r.done, r.finished = bool(done[n]), bool(finished[n])
            drawn += L - j0
        return drawn

    def take(self, batch_groups: int) -> list[Group]:
        """The step's batch: the oldest `batch_groups` complete groups, removed from the carry."""
        ready = sorted(label for label, g in self.groups.items() if g.complete)[:batch_groups]
        return [self.groups.pop(label) for label in ready]

    def carried_rows(self) -> int:
        return sum(not r.done for g in self.groups.values() for r in g.rows)


def pool_rows(batch_groups: int, G: int, oversample: float) -> int:
    """The most rows a call can hold (every group in flight, each with all G rows running): its padded size."""
    return max(batch_groups, math.ceil(oversample * batch_groups)) * G


def pool_slots(slots, batch_groups: int, G: int):
    """The decode slots of a partial-rollout call: rollout.slots when set, else the step's rows (B x G). The call
    holds more rows than that (every group in flight); the others queue, and a row that stops hands its slot to the
    next, so every slot keeps decoding until the step's groups are complete (a slot per row would leave the slots of
    stopped rows idle to the end of the call)."""
    return slots if slots not in (None, "all") else batch_groups * G


def _row_order(group: Group, G: int) -> list[Row]:
    return sorted(group.rows, key=lambda r: r.row_id % G)


def batch_arrays(groups: list[Group], G: int, max_new_tokens: int, pad_id: int) -> dict[str, np.ndarray]:
    """The groups' rows in rollouts.rollout's layout (prompts left-padded to one bucket), plus each token's policy
    version (-1 on padding)."""
    rows = [r for g in groups for r in _row_order(g, G)]
    P = sampler.prompt_bucket(max(len(r.prompt) for r in rows))
    N = len(rows)
    out = dict(prompt_tokens=np.full((N, P), pad_id, np.int32), prompt_mask=np.zeros((N, P), np.bool_),
               tokens=np.full((N, max_new_tokens), pad_id, np.int32), lengths=np.zeros(N, np.int32),
               finished=np.zeros(N, np.bool_), sampler_logp=np.zeros((N, max_new_tokens), np.float32),
               versions=np.full((N, max_new_tokens), -1, np.int32))
    for n, r in enumerate(rows):
        p, L = len(r.prompt), len(r.tokens)
        out["prompt_tokens"][n, P - p:], out["prompt_mask"][n, P - p:] = r.prompt, True
        out["tokens"][n, :L], out["sampler_logp"][n, :L], out["versions"][n, :L] = r.tokens, r.logp, r.versions
        out["lengths"][n], out["finished"][n] = L, r.finished
    return out


def step_stats(ro: dict[str, Any], step: int, carry: Carry, dropped: int, drawn: int, gen_s: float
               ) -> dict[str, float]:
    """rl/carried_rows (rows left running after this step's call), rl/token_lag_mean / _max (policy versions between
    drawing a trained token and the step that trains it), rl/dropped_groups, perf/gen_tokens_per_s."""
    v = ro["versions"]
    lag = (step - v)[v >= 0]
    return {"rl/carried_rows": float(carry.carried_rows()), "rl/dropped_groups": float(dropped),
            "rl/token_lag_mean": float(lag.mean()) if lag.size else 0.0,
            "rl/token_lag_max": float(lag.max()) if lag.size else 0.0,
            "perf/gen_tokens_per_s": drawn / gen_s if gen_s > 0 else 0.0}


def sample_partial(carry: Carry, step: int, version: int, batch_groups: int, G: int, oversample: float,
                   max_lag: int, fresh_prompts: Callable[[int, int], tuple[list, list[int]]], generate: Callable,
                   key: jax.Array, max_new_tokens: int, fresh_limits: Callable[[int, int], list[int]] | None = None):
    """One step's sampling with partial rollouts, in phases (rollouts.DEVICE first, then HOST): -> (the step's B
    groups, dropped groups, new tokens drawn, generation seconds). fresh_prompts(cursor, n) -> (n prompts, their
    example indices); generate(prompts, resume, stop_after_groups, row_limits) runs the sampler (gathered to every
    process); fresh_limits(cursor, n) -> the budgets of the fresh prompts' n x G rows, prompt-major (default
    max_new_tokens each)."""
    carry.begin(step, fallback_cursor=step * max(batch_groups, math.ceil(oversample * batch_groups)))
    dropped, need, fresh = carry.plan(step, batch_groups, oversample, max_lag)
    drawn, gen_s = 0, 0.0
    if need:
        prompts, examples = fresh_prompts(carry.cursor, fresh)
        limits = fresh_limits(carry.cursor, fresh) if fresh_limits else [max_new_tokens] * (fresh * G)
        carry.cursor += fresh
        resumed, carried = carry.resumed()
        t0 = time.perf_counter()
        out = generate(prompts, resumed, need, limits)
        yield rollouts.HOST
        out = sharding.to_host(out)
        gen_s = time.perf_counter() - t0
        key_data = np.asarray(jax.random.key_data(key))
        drawn = carry.absorb(out, step, version, prompts, examples, G, key_data, limits, carried)
    groups = carry.take(batch_groups)
    carry.next_step = step + 1
    if len(groups) < batch_groups:  # cannot happen: the sampler returns once `need` more groups are complete
        raise RuntimeError(f"partial rollouts: {len(groups)} complete groups for a batch of {batch_groups}")
    return groups, dropped, drawn, gen_s


def collect_phases(task, cfg, config, pool, params, rl_step: int, version: int | None = None, *, carry: Carry):
    """rollouts.collect_phases with partial rollouts (rollout.partial): the same outputs and phases, each group of the
    batch assembled from the calls that drew its rows. version: the RL step whose policy `params` are (default
    rl_step; the off-policy pipeline passes it)."""
    ro_cfg, tr = config.rollout, config.train
    G, B = ro_cfg.group_size, ro_cfg.prompts_per_step
    version = rl_step if version is None else version
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), rl_step), 0)
    cut = [0]

    def fresh_prompts(cursor: int, n: int):
        examples = [task.train_batch(i, 1, config.seed)[0] for i in range(cursor, cursor + n)]
        prompts, cut[0] = rollouts.encode_prompts(task, examples, config.data.max_prompt_len)
        return prompts, list(range(cursor, cursor + n))

    def generate(prompts, resume, stop_after_groups, limits):
        out = sampler.generate(cfg, params, prompts, max_new_tokens=ro_cfg.max_new_tokens,
                               temperature=ro_cfg.temperature, top_p=ro_cfg.top_p, top_k=ro_cfg.top_k,
                               min_p=ro_cfg.min_p, eos_ids=cfg.eos_token_ids, seed=key, num_samples=G,
                               pad_id=cfg.pad_token_id, slots=pool_slots(ro_cfg.get("slots", None), B, G),
                               row_max_new_tokens=limits, stop_after_groups=stop_after_groups, resume=resume,
                               min_rows=pool_rows(B, G, ro_cfg.oversample),
                               decode_attention=getattr(ro_cfg, "decode_attention", "auto"))
        return sharding.gather(out)

    groups, dropped, drawn, gen_s = yield from sample_partial(
        carry, rl_step, version, B, G, ro_cfg.oversample, ro_cfg.max_lag, fresh_prompts, generate, key,
        ro_cfg.max_new_tokens)
    yield rollouts.HOST
    ro = batch_arrays(groups, G, ro_cfg.max_new_tokens, cfg.pad_token_id)
    examples = [task.train_batch(g.example, 1, config.seed)[0] for g in groups]
    ro["texts"] = [task.tokenizer.decode(row[:n]) for row, n in zip(ro["tokens"], ro["lengths"])]
    ro["golds"] = [task.gold(ex) for ex in examples for _ in range(G)]
    ro["prompts"] = [task.prompt_text(ex) for ex in examples for _ in range(G)]
    yield from rollouts.score_phases(ro, pool, ro_cfg, tr)
    stats = {"rl/zero_var_groups": float(np.asarray(objectives.zero_variance_groups(ro["rewards"], G)).mean()),
             "rl/prompts_cut": float(cut[0]), **step_stats(ro, rl_step, carry, dropped, drawn, gen_s)}
    stats.update(pool.take_counts())
    return ro, stats


def report_dropped(workdir: str, step: int) -> None:
    """A run resumed at `step` with rollout.partial turned off (allow_config_change): the carry a partial run saved
    for that step is not used; say what it held, rather than drop its rows without a word."""
    path = os.path.join(workdir, "partial", f"carry_{step}.npz")
    if not paths.exists_agreed(path):
        return
    carry = Carry()
    try:
        carry.load_bytes(paths.read_bytes(path))
        held = carry.report()
    except (OSError, ValueError, KeyError) as e:
        held = f"unreadable: {e}"
    log.warning("rollout.partial is off now: the partial rollouts in flight at RL step %d (%s: %s) are dropped, never "
                "trained on; the data stream goes on by step. To keep them, resume with --config.rollout.partial=True",
                step, path, held)
