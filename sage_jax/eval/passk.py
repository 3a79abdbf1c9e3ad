"""pass@k estimation, result tables / plots, resumable sample logs and the sampling eval loop.

Every output file goes through run/paths.py: an output folder may be local or a gs:// prefix."""

from __future__ import annotations

import io
import json
import math
import os
import zlib
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from sage_jax.models import sharding
from sage_jax.run import paths
from sage_jax.sampling import sampler

RewardFn = Callable[[str, Any], float]  # (completion text, Example) -> reward in [0, 1]
GenerateFn = Callable[[list[list[int]], int], "list[list[str]] | Completions"]


class Completions(NamedTuple):
    """What a generate_fn may return instead of bare texts: the texts the reward reads (num_samples per prompt), and
    per prompt the extra fields of its samples.jsonl record (with tools: "turns" and "tools", one per sample)."""
    texts: list[list[str]]
    extra: list[dict[str, Any]]

# ------------------------------------------------------------------------------------------------ pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    """
    if not (0 <= c <= n) or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1, got n={n} c={c} k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_array(n: int | Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """pass@k per problem for arrays of correct counts (n scalar or per problem), via log-space cumulative sums."""
    c_P = np.asarray(c, dtype=np.int64)
    n_P = np.broadcast_to(np.asarray(n, dtype=np.int64), c_P.shape)
    if np.any(c_P < 0) or np.any(c_P > n_P) or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1 (k={k})")
    if np.any(k > n_P):
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={int(n_P.min())}")
    out_P = np.ones(c_P.shape, dtype=np.float64)
    for n_value in np.unique(n_P):
        # log_fail[j] = sum_{i=k+1}^{j} log(1 - k/i); pass = 1 - exp(log_fail[n] - log_fail[n-c]) when n-c >= k.
        i = np.arange(k + 1, n_value + 1, dtype=np.float64)
        log_fail = np.concatenate([np.zeros(k + 1), np.cumsum(np.log1p(-k / i))])
        rows = (n_P == n_value) & (n_value - c_P >= k)
        out_P[rows] = 0.0 - np.expm1(log_fail[n_value] - log_fail[n_value - c_P[rows]])
    return out_P


def pass_at_k_table(correct_counts: Sequence[int], n: int | Sequence[int], ks: Iterable[int]) -> dict[int, float]:
    """Mean pass@k over problems for each k."""
    if len(correct_counts) == 0:
        raise ValueError("pass_at_k_table needs at least one problem")
    return {int(k): float(pass_at_k_array(n, correct_counts, int(k)).mean()) for k in ks}


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n (and n itself)."""
    ks = [2**i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []
    return ks + ([n] if ks and ks[-1] != n else [])

# ------------------------------------------------------------------------------------------------ writers


def markdown_table(results: Mapping[str, Mapping[int, float]], ks: Sequence[int] | None = None,
                   digits: int = 3) -> str:
    """One row per run (results: run name -> {k: pass@k}), one column per k."""
    ks = sorted({int(k) for row in results.values() for k in row}) if ks is None else list(ks)
    lines = ["| run | " + " | ".join(f"pass@{k}" for k in ks) + " |", "|---|" + "---:|" * len(ks)]
    for name, row in results.items():
        cells = [f"{row[k]:.{digits}f}" if k in row else "" for k in ks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _atomic_write(path: str | os.PathLike, text: str) -> None:
    paths.write_text(path, text)  # a temporary name then a rename locally; one upload on a bucket


def write_markdown(path: str | os.PathLike, results: Mapping[str, Mapping[int, float]],
                   ks: Sequence[int] | None = None, title: str | None = None) -> None:
    _atomic_write(path, (f"# {title}\n\n" if title else "") + markdown_table(results, ks))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    _atomic_write(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def plot_pass_at_k(curves: Mapping[str, Mapping[int, float]], path: str | os.PathLike, title: str = "") -> None:
    """pass@k against k (log2 axis), one line per run, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, curve in curves.items():
        ks = sorted(int(k) for k in curve)
        ax.plot(ks, [curve[k] for k in ks], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    paths.write_bytes(path, buf.getvalue())

# ------------------------------------------------------------------------------------------------ sample log


class EvalRecorder:
    """Append-only JSONL log, one line per scored problem; reopening it skips problems already present.

    A crash mid-write can leave a truncated last line: it is dropped (and cut from the file) on reopen. A bad line
    anywhere else is corruption and raises ValueError naming the line. With write=False (every process but the
    first of a multi-host run) the file is only read and new records stay in memory.
    """

    def __init__(self, path: str | os.PathLike, write: bool = True):
        self.path = paths.path(path)
        self.write = write
        self.records: list[dict[str, Any]] = []
        self._ids: set[str] = set()
        data = paths.read_agreed(self.path)  # process 0's file on every process: they all sample the same problems
        if data is not None:
            self._load(data)

    def _load(self, data: bytes) -> None:
        pos, lineno = 0, 0
        while pos < len(data):
            newline = data.find(b"\n", pos)
            end = len(data) if newline == -1 else newline + 1
            raw, lineno = data[pos:end], lineno + 1
            is_last = not data[end:].strip()
            if raw.strip():
                try:
                    record = json.loads(raw)
                except ValueError:  # JSONDecodeError and UnicodeDecodeError
                    record = None
                if not isinstance(record, dict) or "id" not in record:
                    if is_last:  # interrupted write: forget it, the problem is re-run
                        if self.write:
                            paths.write_bytes(self.path, data[:pos])
                        return
                    raise ValueError(f"{self.path}:{lineno}: corrupt sample record; delete that line (the problem"
                                     " is then re-run) or the whole file")
                self.records.append(record)
                self._ids.add(str(record["id"]))
            pos = end
        if data and not data.endswith(b"\n") and self.write:
            paths.append_text(self.path, "\n")  # a complete last record that lost its newline

    @property
    def done(self) -> set[str]:
        return set(self._ids)

    def __contains__(self, problem_id: object) -> bool:
        return str(problem_id) in self._ids

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: Mapping[str, Any]) -> None:
        if "id" not in record:
            raise ValueError("sample records need an 'id'")
        record = dict(record, id=str(record["id"]))
        if self.write:
            paths.append_text(self.path, json.dumps(record, ensure_ascii=False) + "\n")
        self.records.append(record)
        self._ids.add(record["id"])


def read_samples(path: str | os.PathLike) -> list[dict[str, Any]]:
    return EvalRecorder(path).records


def summarize(records: Sequence[Mapping[str, Any]], ks: Iterable[int]) -> dict[int, float]:
    """pass@k table from sample records (fields num_correct and n)."""
    return pass_at_k_table([int(r["num_correct"]) for r in records], [int(r["n"]) for r in records], ks)

# ------------------------------------------------------------------------------------------------ sampling

def sampling_chunks(prompts: list[list[int]], n: int, pad_to: int, max_rows: int, seed: int
                    ) -> tuple[int, int, jax.Array]:
    """(B prompts a call holds, samples per prompt per call, the batch's key): a short batch counts as pad_to
    prompts, n is drawn in equal chunks of at most max_rows rows, the key comes from the prompts themselves."""
    B = max(pad_to, len(prompts))
    per_call = max([d for d in range(1, n + 1) if n % d == 0 and d * B <= max_rows] or [1])
    digest = zlib.crc32(np.concatenate([np.asarray(p, np.int64) for p in prompts] + [np.asarray([n])]).tobytes())
    return B, per_call, jax.random.fold_in(jax.random.key(seed), digest & 0x7FFFFFFF)


def make_generate_fn(cfg: Any, params: Any, decode: Callable[[Any], str], sampling: dict[str, Any], seed: int,
                     max_rows: int) -> Callable[..., list[list[str]]]:
    """generate_fn(prompt_token_lists, n, pad_to=0) -> n texts per prompt, for evaluation.evaluate.

    A short batch is padded to pad_to prompts and the n samples are drawn in equal chunks of at most max_rows rows,
    so one compiled program serves a whole dataset. The key comes from the prompts themselves: a resumed or re-run
    batch draws the same samples whatever ran before it. With tools: tool_loop.make_eval_generate_fn.
    """
    def generate_fn(prompts: list[list[int]], n: int, pad_to: int = 0) -> list[list[str]]:
        B, per_call, key = sampling_chunks(prompts, n, pad_to, max_rows, seed)
        padded = list(prompts) + [prompts[0]] * (B - len(prompts))
        texts: list[list[str]] = [[] for _ in prompts]
        for chunk in range(n // per_call):
            out = sampler.generate(cfg, params, padded, num_samples=per_call, seed=jax.random.fold_in(key, chunk),
                                   eos_ids=cfg.eos_token_ids, pad_id=cfg.pad_token_id, **sampling)
            tokens, lengths = sharding.to_host((out.tokens, out.lengths))  # all rows on every process
            for i in range(len(prompts)):
                rows = range(i * per_call, (i + 1) * per_call)
                texts[i] += [decode(tokens[r, :lengths[r]]) for r in rows]
        return texts
    return generate_fn


def tool_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """The tool metrics of records sampled with tools (None without): calls and turns per row, rows that never
    called, and the errors, timeouts and clipped outputs in all."""
    rows = [t for r in records for t in r.get("tools", ())]
    if not rows:
        return None
    calls = np.array([t["calls"] for t in rows], np.float64)
    return {"calls_per_row": float(calls.mean()), "turns": float(calls.mean() + 1),
            "rows_without_calls": float((calls == 0).mean()), "errors": int(sum(t["errors"] for t in rows)),
            "timeouts": int(sum(t["timeouts"] for t in rows)),
            "truncations": int(sum(t["truncations"] for t in rows))}


# ------------------------------------------------------------------------------------------------ eval loop


def get_reward_fn(reward_name: str | RewardFn) -> RewardFn:
    """(completion, Example) -> reward, for "countdown", "math" or "kk" (imported lazily), or a callable as is."""
    if callable(reward_name):
        return reward_name
    if reward_name == "countdown":
        from sage_jax.rewards import countdown

        return lambda completion, ex: countdown.score(completion, ex.meta)
    if reward_name == "math":
        from sage_jax.rewards import math as math_reward

        return lambda completion, ex: float(math_reward.verify(completion, ex.answer))
    if reward_name == "kk":
        from sage_jax.rewards import kk

        return lambda completion, ex: float(kk.score(completion, ex.meta.get("gold", ex.answer)))
    raise ValueError(f"unknown reward {reward_name!r}; use 'countdown', 'math', 'kk' or pass a callable")


def evaluate(
    tokenizer: Any,
    examples: Sequence[Any],
    reward_name: str | RewardFn,
    n: int,
    ks: Sequence[int] | None,
    out_dir: str | os.PathLike,
    generate_fn: GenerateFn,
    batch_problems: int = 8,
    template: str = "plain",
    run_name: str = "model",
    progress: bool = True,
) -> dict[str, Any]:
    """Sample n completions per problem, score them, log them (resumable) and write pass@k tables and a plot.

    generate_fn(prompt_token_lists, num_samples) -> completions text, one list of num_samples per prompt (see
    make_generate_fn), or Completions (texts and extra record fields: with tools, each sample's turns). Writes
    out_dir/{samples.jsonl, results.json, results.md, pass_at_k.png} (results.json with the tool metrics where the
    samples used tools) and returns the results dict.
    """
    from sage_jax.data.tasks import encode_prompt_text
    from sage_jax.data.templates import render
    from tqdm.auto import tqdm

    ks = default_ks(n) if ks is None else sorted(int(k) for k in ks)
    if any(k > n or k < 1 for k in ks):
        raise ValueError(f"every k must be in [1, n={n}], got {ks}")
    reward_fn = get_reward_fn(reward_name)
    out_dir = paths.path(out_dir)
    # every process samples (the sampler is a collective) and scores; only the first writes files (a multi-host run
    # resumes from out_dir, so it must be on a filesystem all hosts read, as the checkpoints are)
    primary = jax.process_index() == 0
    recorder = EvalRecorder(out_dir / "samples.jsonl", write=primary)
    ids = [str(ex.meta.get("id", i)) for i, ex in enumerate(examples)]
    if len(set(ids)) != len(ids):
        raise ValueError("example ids are not unique; resuming needs a unique meta['id'] per example")
    todo = [(pid, ex) for pid, ex in zip(ids, examples) if pid not in recorder]
    wanted = set(ids)
    other_n = {r["n"] for r in recorder.records if r["id"] in wanted} - {n}
    if other_n:
        raise ValueError(f"{recorder.path} holds samples with n={sorted(other_n)}, not n={n}; resume with the same n"
                         " or use a fresh out_dir")
    solved = [r["num_correct"] / r["n"] for r in recorder.records if r["id"] in wanted]
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), disable=not progress, desc="eval",
               unit="problem")
    for start in range(0, len(todo), batch_problems):
        batch = todo[start:start + batch_problems]
        prompts = [render(template, ex.problem) for _, ex in batch]
        completions = generate_fn([encode_prompt_text(tokenizer, template, p) for p in prompts], n)
        extra = completions.extra if isinstance(completions, Completions) else [{}] * len(batch)
        completions = completions.texts if isinstance(completions, Completions) else completions
        if len(completions) != len(batch) or any(len(c) != n for c in completions):
            raise ValueError(f"generate_fn returned {[len(c) for c in completions]} completions for {len(batch)}"
                             f" prompts; expected {n} per prompt")
        for (pid, ex), prompt, texts, fields in zip(batch, prompts, completions, extra):
            rewards = [float(reward_fn(t, ex)) for t in texts]
            num_correct = sum(r >= 1.0 for r in rewards)
            recorder.add({"id": pid, "prompt": prompt, "answer": ex.answer, "n": n, "num_correct": num_correct,
                          "rewards": rewards, "completions": texts, **fields})
            solved.append(num_correct / n)
        bar.update(len(batch))
        bar.set_postfix(pass1=f"{np.mean(solved):.3f}")
    bar.close()
    records = [r for r in recorder.records if r["id"] in wanted]
    table = summarize(records, ks)
    results = {"run": run_name, "n": n, "num_problems": len(records),
               "pass_at_k": {str(k): v for k, v in table.items()}}
    tools = tool_summary(records)
    if tools is not None:
        results["tools"] = tools
    if primary:
        write_json(out_dir / "results.json", results)
        write_markdown(out_dir / "results.md", {run_name: table}, ks)
        plot_pass_at_k({run_name: table}, out_dir / "pass_at_k.png")
    return results
