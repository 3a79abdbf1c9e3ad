"""Tool-integrated rollouts: a row pauses at its tool call's end, the call runs in the tool pool while the other rows
decode, and the row goes on with the tool's output after its tokens (in its decode slot, or through a later sampler
call that prefills it: below). The loop needs only the sampler, the tools, data/segments and the tokenizer, so it
sits here, below both of its users: training/tool_rollouts.py (RL rollouts with rollout.tools) and offline
evaluation (`python -m sage_jax.evaluate --tools ...`, eval/tool_eval.py).

    fmt = format_for(tokenizer.hf, "markdown", tools)         # or "hermes": the chat template's <tool_call> turns
    with ToolPool(tools, num_workers=8) as pool:
        ro = generate_with_tools(generate_fn, prompts, G, fmt, pool, ToolSettings(max_turns=4), max_new_tokens, key)
    ro["tokens"], ro["sampled_mask"], ro["sampler_logp"]      # [N, max_new_tokens]; NaN log-probs where observed

`generate_fn(prompts, num_samples, resume, stop_after_groups, row_max_new_tokens, extra_eos)` is sampler.generate
with the model, params, sampling settings and seed `key` bound (bind_sampler). The call-end tokens (`</tool_call>`,
or every token whose text ends with ```) stop a row at its call.

In the pool (bind_sampler's generate_fn.session: _in_pool): the rows decode in one pool kept on the
device (sampling/session.py), the call-end tokens are its pause ids, and every ToolSettings.steps_per_call decode
steps the loop looks at the rows: a row that paused submits its call (and keeps its slot and cache), a call that
answered has its output appended to its row, which goes on in its slot (the output fed one token per step, never
drawn), so nothing is prefilled again and the pool decodes while tools run; a fence that opens a block is released
at once. Through sampler calls (a scripted generate_fn, or in_pool=False): the call-end tokens are
stop tokens of every call, so a row that writes one leaves the pool (done); a fence that opens a block is a false
stop, drawn past in a call without those stops. Calls return once a share of their groups is complete
(stop_after_groups); the rows still running come back in the next call beside the rows whose tools have answered,
and only when no row is left to decode does the loop wait for a tool. On several processes (a multi-host slice)
every process runs this loop over the same pool calls (or sampler calls); process 0 alone runs the tools and
broadcasts which calls have answered and their outputs (_Answers), so the processes never diverge on the tools'
timing.

A row is token in, token out (data/segments.py): sampled segments keep the ids and behaviour log-probs the sampler
returned; observed segments (tool output, in the template's tool turn or the plain ```output wrapper) are
tokenised once and carry NaN log-probs; each call checks that the ids it carried back in are the row's segments.
One token budget (max_new_tokens) counts both. A malformed call gets an error observation, never a silent end; a row
past rollout.max_turns calls, or whose observation would not fit its budget, ends at its call (truncated).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from sage_jax.data.segments import ToolTurns, clip_output
from sage_jax.sampling.rows import Resumed
from sage_jax.tools.base import ToolOutput, ToolPool
from sage_jax.tools.calls import check_format, find_call


@dataclasses.dataclass(frozen=True)
class ToolSettings:
    max_turns: int = 4  # tool calls per row; a row that makes one more ends there
    max_tool_tokens: int = 512  # a tool's output is cut to this many tokens (head and tail kept)
    return_share: float = 1.0  # a call returns once this share of its groups is complete (rollout.tool_return_share)
    in_pool: bool = True  # rows pause in one pool kept on the device (sampling/session.py) where the sampler offers it
    steps_per_call: int = 16  # in the pool: decode steps between two looks at the rows (paused, stopped, answered)

    def __post_init__(self):
        if self.max_turns < 1 or self.max_tool_tokens < 1 or not 0 < self.return_share <= 1 or \
                self.steps_per_call < 1:
            raise ValueError(f"rollout.max_turns, rollout.max_tool_tokens and steps_per_call must be >= 1 and the "
                             f"return share in (0, 1]; got {self.max_turns}, {self.max_tool_tokens}, "
                             f"{self.steps_per_call}, {self.return_share}")


class ToolFormat:
    """How calls are found in a tokenizer's ids and how outputs become observed ids, for one call format."""

    def __init__(self, hf_tokenizer: Any, call_format: str, tools: dict):
        self.hf, self.call_format = hf_tokenizer, check_format(call_format)
        if call_format == "hermes":
            end = hf_tokenizer.convert_tokens_to_ids("</tool_call>")
            if end is None or end == hf_tokenizer.unk_token_id or hf_tokenizer.decode([end]) != "</tool_call>":
                raise ValueError("the hermes call format needs `</tool_call>` as one token of the vocabulary "
                                 "(Qwen2.5 / Qwen3 have it); use the markdown format for this tokenizer "
                                 "(rollout.tool_format or evaluate's --tool-format)")
            self.end_ids = (int(end),)
            self.turns = ToolTurns(hf_tokenizer, "template", template_kwargs={"tools": [t.schema for t in
                                                                                          tools.values()]})
        else:
            self.end_ids = tuple(i for i in range(len(hf_tokenizer)) if _closes_fence(hf_tokenizer.decode([i])))
            if not self.end_ids:
                raise ValueError("no token of this vocabulary ends with ```: the markdown call format cannot pause "
                                 "rows at their calls")
            self.turns = ToolTurns(hf_tokenizer, "plain")

    def find(self, turn_ids: Sequence[int]):
        return find_call(self.hf.decode(list(turn_ids), skip_special_tokens=False), self.call_format)

    def turn_text(self, turn_ids: Sequence[int]) -> str:
        return self.hf.decode(list(turn_ids), skip_special_tokens=False)

    def observe(self, messages: list[dict], output: str, max_tokens: int) -> tuple[list[int], bool]:
        text, clipped = clip_output(output, self.hf, max_tokens)
        ids = self.turns.observation_ids(messages, text)
        if self.call_format == "markdown":  # the output block on a line of its own, and the newline after it as a
            newline = self.hf.encode("\n", add_special_tokens=False)  # token of its own: a resumed row may not end
            ids += newline  # in a stop token ("```\n" is one)
            if not messages[-1]["content"].endswith("\n"):
                ids = newline + ids
        return ids, clipped


def _closes_fence(text: str) -> bool:
    """A token that may close a ``` block: its text ends with the fence (whitespace after it allowed). It may open
    one too ("```" then "python"): such a stop is a false one, and the row draws on past it (_draw_past)."""
    return text.rstrip().endswith("```")


class _Row:
    """One row on the host: its ids so far (sampled and observed), their log-probs, and what it waits for."""

    def __init__(self, prompt_index: int, prompt: list[int], row_id: int, limit: int):
        self.prompt_index, self.prompt, self.row_id, self.limit = prompt_index, prompt, row_id, limit
        self.tokens: list[int] = []
        self.logp: list[float] = []
        self.sampled: list[int] = []
        self.turn_start = 0  # where the turn being sampled began in tokens
        self.messages: list[dict] = [{"role": "user", "content": "(prompt)"}]
        self.calls = self.errors = self.timeouts = self.clipped = 0
        self.future: concurrent.futures.Future | None = None
        self.done = self.finished = False

    def resumed(self, key) -> Resumed:
        return Resumed(self.prompt, list(self.tokens), list(self.logp), key, self.row_id, self.limit)

    def take_sampled(self, tokens: np.ndarray, logp: np.ndarray, length: int) -> None:
        """The call's output for this row: its carried ids returned as given, then the newly sampled ones."""
        carried = len(self.tokens)
        if [int(t) for t in tokens[:carried]] != self.tokens:
            raise RuntimeError(f"row {self.row_id}: the sampler returned carried ids that are not the row's segments; "
                               "a row's history must never be re-rendered or re-tokenised")
        self.tokens += [int(t) for t in tokens[carried:length]]
        self.logp += [float(x) for x in logp[carried:length]]
        self.sampled += [1] * (length - carried)


def _submit_call(row: _Row, fmt: ToolFormat, pool: "_Answers", settings: ToolSettings) -> None:
    """The row stopped on a call-end token: its call goes to the pool (or it ends: too many calls)."""
    turn = row.tokens[row.turn_start:]
    row.messages.append({"role": "assistant", "content": fmt.turn_text(turn)})
    if row.calls >= settings.max_turns:
        row.done = True  # finished stays False: the row ends at a call it may not make
        return
    row.calls += 1
    call = fmt.find(turn)
    if call is None or call.error:
        message = call.error if call is not None else _CALL_SHAPE[fmt.call_format]
        row.future = concurrent.futures.Future()
        row.future.set_result(_error_output(message))
        return
    row.future = pool.submit(call.name, call.arguments)


_CALL_SHAPE = {"markdown": "a tool call is a closed ```python block",
               "hermes": 'a tool call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>'}


def _error_output(message: str) -> ToolOutput:
    return ToolOutput(f"Error: {message}", ok=False)


def _take_output(row: _Row, fmt: ToolFormat, settings: ToolSettings) -> bool:
    """Appends the row's answered call as an observed segment -> whether the row goes on decoding."""
    out, row.future = row.future.result(), None
    row.errors += int(not out.ok)
    row.timeouts += int(out.timed_out)
    ids, clipped = fmt.observe(row.messages, out.text, settings.max_tool_tokens)
    row.clipped += int(clipped)
    if len(row.tokens) + len(ids) >= row.limit:
        row.done = True  # the observation would fill the row's budget: it ends at its call, truncated
        return False
    row.messages.append({"role": "tool", "content": out.text})
    row.tokens += ids
    row.logp += [math.nan] * len(ids)
    row.sampled += [0] * len(ids)
    row.turn_start = len(row.tokens)
    return True


def _absorb(out, rows: list[_Row], fmt: ToolFormat, pool: "_Answers", settings: ToolSettings
            ) -> tuple[list[_Row], list[_Row]]:
    """Reads one call's output into its rows -> (the rows still running: they go on next call; the rows stopped on
    a call-end token that ends no call, e.g. a fence that opens a block: they draw on past it first)."""
    tokens, logp = np.asarray(out.tokens), np.asarray(out.logprobs)
    lengths, finished, done = np.asarray(out.lengths), np.asarray(out.finished), np.asarray(out.done)
    running, false_stops = [], []
    for n, row in enumerate(rows):
        row.take_sampled(tokens[n], logp[n], int(lengths[n]))
        if not done[n]:
            running.append(row)
        elif finished[n] and row.tokens and row.tokens[-1] in fmt.end_ids:
            if len(row.tokens) >= row.limit:  # its call took its last token: it ends there, truncated
                row.done = True
            elif fmt.call_format == "markdown" and fmt.find(row.tokens[row.turn_start:]) is None:
                false_stops.append(row)
            else:
                _submit_call(row, fmt, pool, settings)
        else:
            _end(row, fmt, bool(finished[n]))
    return running, false_stops


def _end(row: _Row, fmt: ToolFormat, finished: bool) -> None:
    row.done, row.finished = True, finished
    if len(row.tokens) > row.turn_start:  # its last turn, for samples.jsonl
        row.messages.append({"role": "assistant", "content": fmt.turn_text(row.tokens[row.turn_start:])})


def _draw_past(generate_fn: Callable, rows: list[_Row], prompt: list[int], key, fmt: ToolFormat) -> list[_Row]:
    """One more token for rows that stopped on a call-end token ending no call, in a call without the call-end stop
    tokens (a resumed row may not end in a stop token of its call) -> the rows that go on decoding."""
    going = []
    while rows:
        resume = [r.resumed(key)._replace(max_new_tokens=len(r.tokens) + 1) for r in rows]
        out = generate_fn([prompt], 1, resume, None, [1], ())
        tokens, logp, lengths = (np.asarray(x)[1:] for x in (out.tokens, out.logprobs, out.lengths))
        finished, again = np.asarray(out.finished)[1:], []
        for n, row in enumerate(rows):
            row.take_sampled(tokens[n], logp[n], int(lengths[n]))
            if finished[n] or len(row.tokens) >= row.limit:
                _end(row, fmt, bool(finished[n]))
            else:
                (again if row.tokens[-1] in fmt.end_ids else going).append(row)
        rows = again
    return going


class _Answers:
    """Which calls have answered, decided once for every process. One process: the calls whose futures are done.
    Several (a multi-host slice): process 0 alone runs the tools, and each time says which calls have answered and
    what they returned (a broadcast), so every process carries the same rows into the same sampler calls, in the
    same order, whatever the tools' timing; the other processes' calls are futures that only a broadcast fills."""

    def __init__(self, pool: ToolPool):
        import jax
        self.pool, self.lead, self.shared = pool, jax.process_index() == 0, jax.process_count() > 1

    def submit(self, name: str, arguments: Any) -> concurrent.futures.Future:
        return self.pool.submit(name, arguments) if self.lead else concurrent.futures.Future()

    def answered(self, rows: list[_Row]) -> list[_Row]:
        done = [r for r in rows if r.future is not None and r.future.done()]
        if not self.shared:
            return done
        said = _broadcast([[r.row_id, *dataclasses.astuple(r.future.result())] for r in done] if self.lead else None)
        by_id, out = {r.row_id: r for r in rows}, []
        for row_id, *fields in said:
            row = by_id[row_id]
            row.future = concurrent.futures.Future()
            row.future.set_result(ToolOutput(*fields))
            out.append(row)
        return out

    def wait(self, rows: list[_Row]) -> float:
        """Until a call answers (process 0; the others wait in the next broadcast) -> seconds waited."""
        pending = [r.future for r in rows if r.future is not None and (self.lead or not self.shared)]
        start = time.perf_counter()
        concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        return time.perf_counter() - start


def _broadcast(message: Any) -> Any:
    """Process 0's JSON-able message, on every process (the others pass None)."""
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(message).encode(), np.uint8) if message is not None else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    buffer = np.zeros(size, np.uint8)
    buffer[:data.size] = data[:size]
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes().decode())


def generate_with_tools(generate_fn: Callable, prompts: Sequence[Sequence[int]], num_samples: int, fmt: ToolFormat,
                        pool: ToolPool, settings: ToolSettings, max_new_tokens: int, key) -> dict[str, Any]:
    """Rollouts of G = num_samples rows per prompt with tool calls (module docstring) -> host arrays and stats."""
    G, prompts = num_samples, [[int(t) for t in p] for p in prompts]
    rows = [_Row(b, prompts[b], b * G + g, max_new_tokens) for b in range(len(prompts)) for g in range(G)]
    t0, waited, calls, answers = time.perf_counter(), 0.0, 1, _Answers(pool)
    start_session = getattr(generate_fn, "session", None)
    if start_session is not None and settings.in_pool:
        session = start_session(prompts, G, fmt.end_ids, settings.steps_per_call)
        waited = _in_pool(session, rows, fmt, answers, settings)
        return _arrays(rows, max_new_tokens, waited, time.perf_counter() - t0, session.calls)
    stop = max(1, math.ceil(settings.return_share * len(prompts)))
    running, false_stops = _absorb(generate_fn(prompts, G, (), stop, None, fmt.end_ids), rows, fmt, answers,
                                   settings)
    while True:
        running += _draw_past(generate_fn, false_stops, prompts[0], key, fmt) if false_stops else []
        answered = answers.answered(rows)
        if not running and not answered:
            if not any(r.future is not None for r in rows):
                break
            waited += answers.wait(rows)
            false_stops = []
            continue
        back = running + [r for r in answered if _take_output(r, fmt, settings)]
        running, false_stops = [], []
        if not back:
            continue
        # generate needs a fresh prompt: one throwaway row of one token, a group of its own that completes at once
        stop = 1 + max(1, math.ceil(settings.return_share * len(back)))
        out = generate_fn([prompts[0]], 1, [r.resumed(key) for r in back], stop, [1], fmt.end_ids)
        calls += 1
        out = type(out)(**{k: (v[1:] if v is not None and np.ndim(v) else v)  # the per-row fields, not the counts
                           for k, v in out._asdict().items()})
        running, false_stops = _absorb(out, back, fmt, answers, settings)
    return _arrays(rows, max_new_tokens, waited, time.perf_counter() - t0, calls)


def _in_pool(session, rows: list[_Row], fmt: ToolFormat, answers: _Answers, settings: ToolSettings) -> float:
    """The rows decoded in one pool kept on the device (sampling/session.py): a row pauses in its slot, cache
    kept, at its call's end, the other rows decode on while the call runs, and it goes on in its slot with the output
    appended (fed one token per step), so nothing is prefilled again -> seconds waited with no row to decode."""
    waited = 0.0  # a row's index is its row_id (prompt-major, as the session's rows)
    while True:  # every steps_per_call decode steps: the rows that paused or stopped, and the calls answered
        ran = session.advance()
        for n in session.newly_stopped():
            row = rows[n]
            row.take_sampled(*session.row(n), int(session.lengths[n]))
            if session.done[n]:  # EOS or its budget (a call end at the budget's last token: it ends there)
                _end(row, fmt, bool(session.finished[n])) if not session.paused[n] else setattr(row, "done", True)
            elif fmt.call_format == "markdown" and fmt.find(row.tokens[row.turn_start:]) is None:
                session.release(n)  # a fence that opens a block: it draws on
            else:
                _submit_call(row, fmt, answers, settings)
                if row.done:  # one call more than max_turns: it ends at its call
                    session.end(n)
        answered = answers.answered(rows)
        for row in answered:
            before = len(row.tokens)
            if _take_output(row, fmt, settings):
                session.append(row.row_id, row.tokens[before:])
            else:
                session.end(row.row_id)
        if ran or answered:
            continue
        if not any(r.future is not None for r in rows):
            if session.decoding():
                raise RuntimeError("the pool stopped with rows left to decode and no tool call pending")
            return waited
        waited += answers.wait(rows)


def _arrays(rows: list[_Row], C: int, waited_s: float, total_s: float, calls: int) -> dict[str, Any]:
    N = len(rows)
    ro = {"tokens": np.zeros((N, C), np.int32), "sampler_logp": np.zeros((N, C), np.float32),
          "sampled_mask": np.zeros((N, C), np.int32), "lengths": np.array([len(r.tokens) for r in rows], np.int32),
          "finished": np.array([r.finished for r in rows], bool)}
    for n, r in enumerate(rows):
        L = len(r.tokens)
        ro["tokens"][n, :L], ro["sampler_logp"][n, :L], ro["sampled_mask"][n, :L] = r.tokens, r.logp, r.sampled
    count = lambda name: np.array([getattr(r, name) for r in rows], np.float32)
    ro["tool_stats"] = {
        "tools/calls_per_row": float(count("calls").mean()), "tools/turns": float((count("calls") + 1).mean()),
        "tools/errors": float(count("errors").sum()), "tools/timeouts": float(count("timeouts").sum()),
        "tools/truncations": float(count("clipped").sum()), "tools/rows_without_calls": float(
            (count("calls") == 0).mean()), "tools/wait_s": waited_s, "tools/rollout_s": total_s,
        "tools/sampler_calls": float(calls)}  # sampler programs run (in the pool: its calls of steps_per_call steps)
    ro["messages"] = [r.messages for r in rows]
    ro["row_tools"] = [{"calls": r.calls, "errors": r.errors, "timeouts": r.timeouts, "truncations": r.clipped}
                       for r in rows]
    return ro


def settings_from(rollout_cfg) -> ToolSettings:
    return ToolSettings(max_turns=int(getattr(rollout_cfg, "max_turns", 4)),
                        max_tool_tokens=int(getattr(rollout_cfg, "max_tool_tokens", 512)),
                        return_share=float(getattr(rollout_cfg, "tool_return_share", 1.0)))


_FORMATS: dict[tuple, ToolFormat] = {}


def format_for(hf_tokenizer: Any, call_format: str, tools: dict) -> ToolFormat:
    """ToolFormat, made once per tokenizer, format and tool names (markdown reads every token's text)."""
    cache_key = (id(hf_tokenizer), call_format, tuple(tools))
    if cache_key not in _FORMATS:
        _FORMATS[cache_key] = ToolFormat(hf_tokenizer, call_format, tools)
    return _FORMATS[cache_key]


def bind_sampler(cfg, params, sampling: dict[str, Any], key, min_rows: int, slots=None) -> Callable:
    """generate_with_tools' generate_fn: sampler.generate with the model, the sampling settings (max_new_tokens,
    temperature, top_p, top_k, min_p) and the seed `key` bound, so a resumed row draws as it would have uninterrupted;
    the calls that carry rows back are padded to min_rows rows (one program for all of them)."""
    from sage_jax.models import sharding
    from sage_jax.sampling import sampler
    from sage_jax.sampling.session import PoolSession
    base_eos = tuple(cfg.eos_token_ids)

    def generate_fn(prompts, num_samples, resume, stop_after_groups, limits, extra_eos):
        out = sampler.generate(cfg, params, prompts, **sampling, eos_ids=base_eos + tuple(extra_eos), seed=key,
                               num_samples=num_samples, pad_id=cfg.pad_token_id, slots=slots,
                               row_max_new_tokens=limits, stop_after_groups=stop_after_groups, resume=resume,
                               min_rows=min_rows if resume else 0)
        return sharding.to_host(out)

    def session(prompts, num_samples, pause_ids, steps_per_call):  # generate_with_tools' in-pool path
        return PoolSession(cfg, params, prompts, **sampling, eos_ids=base_eos, seed=key, num_samples=num_samples,
                           pad_id=cfg.pad_token_id, slots=slots, pause_ids=pause_ids, steps_per_call=steps_per_call)
    generate_fn.session = session
    return generate_fn


def sampled_texts(ro: dict[str, Any], decode: Callable) -> list[str]:
    """Each row's own text: its sampled tokens only, never a tool's output (what a reward reads)."""
    return [decode(row[:n][mask[:n] > 0]) for row, n, mask in zip(ro["tokens"], ro["lengths"], ro["sampled_mask"])]
