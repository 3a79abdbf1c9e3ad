"""Training-side benchmarks: the jitted train step, one whole RL step against TRL, the loss's memory, scaling.

  python -m sage_jax.bench_train train_step --preset small --dtype fp32 --batch 64
  python -m sage_jax.bench_train train_step --preset small --batch 16 --ablate   # remat / scan / chunk / bf16 / rows
  python -m sage_jax.bench_train flags --preset small --batch 16                  # XLA_FLAGS sets, a process each
  python -m sage_jax.bench_train matmul                                           # the peak: jitted square matmuls
  python -m sage_jax.bench_train rl_step --preset small                           # vs trl.GRPOTrainer, same weights
  python -m sage_jax.bench_train rl_step --preset small --new-tokens 512 --workload longtail --layout both
  python -m sage_jax.bench_train memory                                           # chunked vs naive log-probs
  python -m sage_jax.bench_train scaling --plot docs/perf_scaling.png

`--batch` counts rows (prompts x samples). Each number is the median of `--repeats` runs after a warm-up run; the
runs of everything compared are interleaved, so load from other processes hits all alike. FLOP/s are given as a
fraction of a jitted square matmul's FLOP/s timed in the same loop: this machine's achievable peak, under the same load.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax import config as config_lib
from sage_jax import guides, model, objectives, packing, rollouts, sampler, train_state, workloads

MODES: dict[str, Callable[[argparse.Namespace], list[dict]]] = {}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# the default SAGE arm: the loss defaults (k3 anchor, beta 0.05, GRPO aggregation) with the Branch guide, and the
# optimizer of configs/base.py: one source for both
SAGE_LOSS = objectives.LossConfig(guide=guides.GuideConfig(name="branch"))
OPTIM = config_lib.load(str(Path(__file__).resolve().parents[1] / "configs" / "base.py")).optim
ABLATIONS = {  # variant -> ModelConfig overrides; "rows" scales the batch instead
    "default": {}, "remat": {"remat": True}, "no_scan": {"scan_layers": False}, "chunk_128": {"logits_chunk": 128},
    "chunk_2048": {"logits_chunk": 2048}, "bf16_compute": {"compute_dtype": "bfloat16"}, "rows_x0.25": {"rows": 0.25},
    "rows_x0.5": {"rows": 0.5},
}
EOS_ID = 1  # word_level_tokenizer's "<eos>": the token both sides end a forced-length completion with
FLAG_SETS = {"default": "", "onednn": "--xla_cpu_use_onednn=true", "xnnpack": "--xla_cpu_use_xnnpack=true",
             "eigen_1_thread": "--xla_cpu_multi_thread_eigen=false"}


def register(name: str):
    def wrap(fn):
        MODES[name] = fn
        return fn
    return wrap


# --------------------------------------------------------------------------------------------------- helpers

def interleaved_seconds(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each fn per round: one warm-up call each, then `repeats` rounds calling each once. Each round
    starts one further down the list, so no fn always runs first (or right after the same neighbour)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    return times


def matmul_peak_fn(dtype: str, size: int = 2048, calls: int = 4) -> tuple[Callable[[], jax.Array], float]:
    """(fn, flops): `calls` jitted [size, size] @ [size, size] (bf16 inputs accumulate in fp32 for "bf16"); several
    calls so each timing spans long enough to see the same load as the step it is compared with."""
    a = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(DTYPES[dtype])
    mm = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    return (lambda: [mm(a) for _ in range(calls)]), 2.0 * size ** 3 * calls


def bench_matmul(dtypes=("fp32", "bf16"), sizes=(1024, 2048), repeats: int = 3) -> list[dict]:
    """GFLOP/s of jitted square matmuls: the peak the train step is measured against."""
    fns = {(d, n): matmul_peak_fn(d, n) for d in dtypes for n in sizes}
    times = interleaved_seconds({k: f for k, (f, _) in fns.items()}, repeats)
    out = [dict(dtype=d, size=n, seconds=statistics.median(times[(d, n)]),
                gflops_per_s=fns[(d, n)][1] / statistics.median(times[(d, n)]) / 1e9) for d, n in fns]
    print_table(out, [("dtype", ""), ("size", "d"), ("seconds", ".3f"), ("gflops_per_s", ".1f")])
    return out


@register("matmul")
def _matmul_mode(args: argparse.Namespace) -> list[dict]:
    sizes = tuple(int(n) for n in str(getattr(args, "sizes", "1024,2048")).split(","))
    return bench_matmul(("fp32", "bf16"), sizes, args.repeats)


def train_flops(cfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int) -> float:
    """Model FLOPs of one forward + backward (3x forward): 2 * matmul params per token over all T tokens, attention
    scores and mixing over all T keys (XLA computes the masked half too), and the unembedding on completion
    positions only (the loss needs nothing else). Embedding lookups and norms are not matmuls and are left out."""
    T = prompt_len + completion_len
    D, V = cfg.hidden_size, cfg.vocab_size
    return 3.0 * rows * (T * (2 * _layer_params(cfg) + _attention_per_key(cfg) * T) + completion_len * 2 * D * V)


def _layer_params(cfg: model.ModelConfig) -> int:
    """Parameters of the decoder layers (all but the embedding, unembedding and final norm)."""
    return cfg.num_params - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2) - cfg.hidden_size


def _attention_per_key(cfg: model.ModelConfig) -> int:
    """FLOPs per query position per attended key over all layers: scores and mixing, 2 x 2 x heads x head_dim."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


def decode_flops(cfg: model.ModelConfig, prompts: int, samples: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of sampler.generate as XLA runs it: the prefill of each prompt once at its bucket length (2 x
    matmul params per token, attention over the bucket, the unembedding at the last position), then new_tokens - 1
    decode steps for all prompts x samples rows (the first token comes from the prefill), each 2 x matmul params plus
    the unembedding per row and attention over every slot of the cache (prompt bucket + new-token bucket)."""
    P, C = sampler.prompt_bucket(prompt_len), sampler.new_tokens_bucket(new_tokens)
    D, V = cfg.hidden_size, cfg.vocab_size
    layer_params, attention_per_slot = _layer_params(cfg), _attention_per_key(cfg)
    prefill = prompts * (P * (2 * layer_params + attention_per_slot * P) + 2 * D * V)
    rows = prompts * samples
    return prefill + (new_tokens - 1) * rows * (2 * layer_params + 2 * D * V + attention_per_slot * (P + C))


def random_loss_batch(cfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int, seed: int = 0,
                      rl_step: int = 0) -> dict[str, np.ndarray]:
    """A loss batch (objectives.loss_fn layout) of random full-length rows."""
    rng = np.random.default_rng(seed)
    T = prompt_len + completion_len
    near_uniform = lambda: (-np.log(cfg.vocab_size) + 0.1 * rng.standard_normal((rows, completion_len))).astype(
        np.float32)
    return {"tokens": rng.integers(1, cfg.vocab_size, (rows, T)).astype(np.int32),
            "mask": np.ones((rows, T), np.int32), "completion_mask": np.ones((rows, completion_len), np.float32),
            "advantages": rng.standard_normal(rows).astype(np.float32), "ref_logp": near_uniform(),
            "sampler_logp": near_uniform(), "truncated": np.ones(rows, np.bool_), "rl_step": np.int32(rl_step)}


def preset_config(preset: str, dtype: str, **overrides) -> model.ModelConfig:
    """Params in fp32 for training (bf16 only as the compute dtype, as configs/base.py does)."""
    return model.preset(preset, **{"param_dtype": "float32", "compute_dtype": DTYPES[dtype], "eos_token_ids": (),
                                   **overrides})


def lowered_train_step(cfg: model.ModelConfig, loss_cfg: objectives.LossConfig, rows: int, prompt_len: int,
                       completion_len: int, seed: int = 0):
    """(tx, train_state.make_train_step lowered for these shapes); nothing is allocated."""
    tx, schedule = train_state.make_optimizer(OPTIM, 1000)
    abstract = jax.eval_shape(lambda: train_state.init_state(model.init_params(cfg, jax.random.key(seed)), tx))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                         random_loss_batch(cfg, rows, prompt_len, completion_len))
    return tx, train_state.make_train_step(cfg, loss_cfg, tx, schedule, seed).lower(abstract, batch)


@functools.lru_cache(maxsize=32)
def compiled_train_step(cfg: model.ModelConfig, loss_cfg: objectives.LossConfig, rows: int, prompt_len: int,
                        completion_len: int, seed: int = 0):
    """(tx, compiled train step); cached so modes (and tests) with the same shapes share one compilation."""
    tx, lowered = lowered_train_step(cfg, loss_cfg, rows, prompt_len, completion_len, seed)
    return tx, lowered.compile()


def _train_runner(cfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int, seed: int = 0,
                  params=None, loss_cfg: objectives.LossConfig = SAGE_LOSS):
    """(run, compiled): run(batch=None) does one donated train step (on a fixed random batch by default) and
    returns its metrics."""
    tx, compiled = compiled_train_step(cfg, loss_cfg, rows, prompt_len, completion_len, seed)
    if params is None:
        params = jax.jit(model.init_params, static_argnums=0)(cfg, jax.random.key(seed))
    box = {"state": train_state.init_state(params, tx)}
    fixed = jax.device_put(random_loss_batch(cfg, rows, prompt_len, completion_len, seed))

    def run(batch=None):
        box["state"], metrics = compiled(box["state"], fixed if batch is None else batch)
        return metrics
    return run, compiled


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", float("nan")))


def _presets(preset: str) -> tuple[str, ...]:
    return ("tiny", "small") if preset == "both" else (preset,)


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, format spec); a missing key prints as '-'."""
    cell = lambda r, k, f: format(r[k], f) if r.get(k) is not None else "-"
    widths = {k: max(len(k), *(len(cell(r, k, f)) for r in rows)) for k, f in columns}
    print("  ".join(k.rjust(widths[k]) for k, _ in columns))
    for r in rows:
        print("  ".join(cell(r, k, f).rjust(widths[k]) for k, f in columns))


# --------------------------------------------------------------------------------------------------- train step

def bench_train_step(preset: str = "tiny", dtype: str = "fp32", rows: int = 64, prompt_len: int = 32,
                     completion_len: int = 128, repeats: int = 3, variants: dict[str, dict] | None = None,
                     peak_size: int = 2048, seed: int = 0) -> list[dict]:
    """Tokens/s and FLOP/s of train_state.make_train_step (SAGE loss, AdamW) per variant, against the matmul peak."""
    variants = variants or {"default": {}}
    peak_fn, peak_flops = matmul_peak_fn(dtype, peak_size)
    fns, info = {"matmul_peak": peak_fn}, {}
    for name, overrides in variants.items():
        overrides = dict(overrides)
        n = max(1, int(rows * overrides.pop("rows", 1)))
        cfg = preset_config(preset, dtype, **overrides)
        start = time.perf_counter()
        fns[name], compiled = _train_runner(cfg, n, prompt_len, completion_len, seed)
        info[name] = dict(rows=n, flops=train_flops(cfg, n, prompt_len, completion_len),
                          compile_s=time.perf_counter() - start, xla_gflops=_xla_flops(compiled) / 1e9)
    times = interleaved_seconds(fns, repeats)
    peak = peak_flops / statistics.median(times["matmul_peak"])
    out = []
    for name, v in info.items():
        s = statistics.median(times[name])
        out.append(dict(preset=preset, dtype=dtype, variant=name, rows=v["rows"], seq=prompt_len + completion_len,
                        seconds=s, tokens_per_s=v["rows"] * (prompt_len + completion_len) / s,
                        model_gflops=v["flops"] / 1e9, gflops_per_s=v["flops"] / s / 1e9, peak_gflops_per_s=peak / 1e9,
                        frac_of_peak=v["flops"] / s / peak, compile_s=v["compile_s"], xla_gflops=v["xla_gflops"],
                        runs_s=times[name], peak_runs_s=times["matmul_peak"]))
    print_table(out, [("preset", ""), ("dtype", ""), ("variant", ""), ("rows", "d"), ("seq", "d"), ("seconds", ".3f"),
                      ("tokens_per_s", ".0f"), ("gflops_per_s", ".1f"), ("peak_gflops_per_s", ".1f"),
                      ("frac_of_peak", ".2f"), ("compile_s", ".1f")])
    return out


@register("train_step")
def _train_step_mode(args: argparse.Namespace) -> list[dict]:
    variants = ABLATIONS if getattr(args, "ablate", False) else None
    return [r for p in _presets(args.preset) for r in bench_train_step(
        p, args.dtype, args.batch, args.prompt_len, args.new_tokens, args.repeats, variants)]


def bench_flags(flag_sets: dict[str, str] | None = None, mode: str = "train_step", mode_args: tuple[str, ...] = (),
                metric: str = "tokens_per_s", rounds: int = 2) -> list[dict]:
    """`python -m sage_jax.bench_train <mode> <mode_args>` under each XLA_FLAGS set, each run a fresh process (XLA
    reads its flags once); rounds interleave the sets. A row per (set, row of the mode): numbers are medians over
    rounds, `speedup` is `metric` over the first set's."""
    flag_sets = flag_sets or FLAG_SETS
    root = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, "-m", "sage_jax.bench_train", mode, "--json", *mode_args]
    runs: dict[str, list[list[dict]]] = {name: [] for name in flag_sets}
    for _ in range(rounds):
        for name, flags in flag_sets.items():
            env = dict(os.environ, XLA_FLAGS=" ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags) if f),
                       PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
            proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"{' '.join(cmd[1:])} under XLA_FLAGS={flags!r} failed:\n{proc.stderr[-3000:]}")
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1])["modes"][mode])
    out = []
    for name, per_round in runs.items():
        for i, template in enumerate(per_round[0]):
            row = {k: (statistics.median(r[i][k] for r in per_round) if isinstance(v, float) else v)
                   for k, v in template.items() if not isinstance(v, list)}
            out.append(dict(flags=name, xla_flags=flag_sets[name], **row))
    first = out[:len(runs[next(iter(runs))][0])]
    for j, r in enumerate(out):
        r["speedup"] = r[metric] / first[j % len(first)][metric]
    print_table(out, [("flags", ""), *[(k, ".3g" if isinstance(v, float) else "") for k, v in out[0].items()
                                       if k not in ("flags", "xla_flags", "speedup")], ("speedup", ".2f")])
    return out


@register("flags")
def _flags_mode(args: argparse.Namespace) -> list[dict]:
    """Flag sets on the train step (the preset, dtype and shapes given) and on the matmul peak."""
    step_args = ("--preset", args.preset, "--dtype", args.dtype, "--batch", str(args.batch), "--prompt-len",
                 str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats))
    return (bench_flags(None, "matmul", ("--repeats", str(args.repeats)), "gflops_per_s")
            + bench_flags(None, "train_step", step_args, "tokens_per_s"))


# --------------------------------------------------------------------------------------------------- RL step

def ids_reward(ids) -> float:
    """Trivial in-process reward: the share of even token ids (varies across a group, so advantages are non-zero)."""
    ids = np.asarray(ids)
    return float((ids % 2 == 0).mean()) if ids.size else 0.0


def trl_ids_reward(completions, completion_ids, **_) -> list[float]:
    return [ids_reward(ids) for ids in completion_ids]


def _forced_rollout(out, lengths_N: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """A rollout dict (rollouts.build_batch input) from a sample of max_new_tokens, cut to the forced lengths: row n
    ends with EOS at lengths[n] - 1 unless it runs to the limit (truncated)."""
    N, C = out.tokens.shape
    finished = lengths_N < C
    tokens = np.where(np.arange(C)[None] < lengths_N[:, None], out.tokens, 0)
    tokens[np.flatnonzero(finished), lengths_N[finished] - 1] = eos_id
    return dict(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=tokens, lengths=lengths_N,
                finished=finished, sampler_logp=np.where(tokens > 0, out.logprobs, 0.0))


def _sage_rl_runner(cfg: model.ModelConfig, params, prompts_BxP: np.ndarray, group: int, lengths_N: np.ndarray,
                    beta: float, seed: int = 0, packed: bool = True) -> Callable[[], dict[str, float]]:
    """run() does one RL step as trainer.run_rl does (sample -> reward -> advantages -> reference log-probs ->
    one update), completions forced to lengths_N (EOS at the end unless at the limit), and returns its seconds per
    phase. packed: the reference pass and the update on packed rows (packing.py), else on padded rows."""
    loss_cfg = dataclasses.replace(SAGE_LOSS, beta=beta)
    new_tokens = int(lengths_N.max())
    tx, schedule = train_state.make_optimizer(OPTIM, 1000)
    train_step = train_state.make_train_step(cfg, loss_cfg, tx, schedule, seed,
                                         loss_fn=packing.loss_fn if packed else None)
    ref_params = jax.tree.map(jnp.copy, params)
    box = {"state": train_state.init_state(jax.tree.map(jnp.copy, params), tx), "step": 0}
    prompts = prompts_BxP.tolist()

    def run() -> dict[str, float]:
        i, t = box["step"], [time.perf_counter()]
        box["step"] += 1
        out = jax.device_get(sampler.generate(cfg, box["state"]["params"], prompts, new_tokens, temperature=1.0,
                                              eos_ids=(), seed=seed + i, num_samples=group))
        ro = _forced_rollout(out, lengths_N, EOS_ID)
        t.append(time.perf_counter())
        rewards_N = np.array([ids_reward(row[:n]) for row, n in zip(ro["tokens"], ro["lengths"])], np.float32)
        t.append(time.perf_counter())
        adv_N = objectives.group_advantages(rewards_N, group, scale=loss_cfg.adv_scale)
        batch = rollouts.build_batch(ro, np.asarray(adv_N), cfg.pad_token_id, new_tokens, packed=packed)
        if packing.is_packed(batch):
            batch["ref_logp"], _ = packing.sequence_logprobs(cfg, ref_params, batch, temperature=loss_cfg.temperature)
        else:
            batch["ref_logp"], _ = train_state.sequence_logprobs(cfg, ref_params, batch["tokens"], batch["mask"],
                                                                 prompt_len=out.prompt_tokens.shape[1],  # the bucket
                                                                 temperature=loss_cfg.temperature)
        jax.block_until_ready(batch["ref_logp"])
        t.append(time.perf_counter())
        box["state"], metrics = train_step(box["state"], dict(batch, rl_step=np.int32(i)))
        jax.block_until_ready(metrics)
        t.append(time.perf_counter())
        return dict(seconds=t[4] - t[0], generate_s=t[1] - t[0], reward_s=t[2] - t[1], ref_s=t[3] - t[2],
                    update_s=t[4] - t[3], padded_frac=packing.padded_fraction(batch))
    return run


def word_level_tokenizer(vocab_size: int):
    """A PreTrainedTokenizerFast with the model's ids: "<pad>" 0, "<eos>" 1, "t<i>" i; a prompt of n space-separated
    words is exactly n tokens (no special tokens added)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def _force_lengths_in_generate(hf_model, lengths_N: np.ndarray | None, eos_id: int, realised: list) -> None:
    """Make hf_model.generate end row n with EOS at step lengths[n] - 1 (never earlier), as _forced_rollout does
    (lengths_N None: as it is); appends each call's completion lengths (the EOS included) to `realised`."""
    import torch
    import transformers

    class ForcedLengths(transformers.LogitsProcessor):
        def __init__(self, prompt_width):
            self.prompt_width = prompt_width

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.prompt_width
            stop = torch.as_tensor(lengths_N - 1 == step)
            scores[:, eos_id] = -float("inf")
            scores[stop] = torch.where(torch.arange(scores.shape[1]) == eos_id, 0.0, -float("inf"))
            return scores

    generate = hf_model.generate

    def forced(*args, **kw):
        width = kw["input_ids"].shape[1]
        if lengths_N is not None:
            kw["logits_processor"] = transformers.LogitsProcessorList([ForcedLengths(width)])
        out = generate(*args, **kw)
        is_eos = (out[:, width:] == eos_id).numpy()
        realised.append(np.where(is_eos.any(1), is_eos.argmax(1) + 1, is_eos.shape[1]))
        return out
    hf_model.generate = forced


def _trl_interleaved(model_dir: str, vocab_size: int, prompts_BxP: np.ndarray, group: int, lengths_N: np.ndarray,
                     beta: float, steps: int, between: Callable[[], None], seed: int = 0,
                     realised: list | None = None) -> list[dict[str, float]]:
    """`steps` trl.GRPOTrainer steps on model_dir (8 prompts x G per step when B = 8); between() runs after each.
    Completion n of a step has lengths_N[n] tokens (min_new_tokens when all are equal, else a logits processor);
    the lengths TRL generated are appended to `realised`.

    Per step: seconds from on_step_begin to on_step_end (the whole step: generate, reward, reference log-probs,
    update) and the time inside `_generate` and `_generate_and_score_completions` (what remains is the update)."""
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(os.cpu_count() or 1)
    B = prompts_BxP.shape[0]
    new_tokens, fixed = int(lengths_N.max()), bool(np.all(lengths_N == lengths_N.max()))
    texts = [" ".join(f"t{i}" for i in row) for row in prompts_BxP]
    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=B * group, num_generations=group,
            max_completion_length=new_tokens, generation_kwargs={"min_new_tokens": new_tokens} if fixed else {},
            beta=beta,
            num_iterations=1, loss_type="grpo", use_vllm=False, report_to="none", bf16=False, use_cpu=True,
            max_steps=steps, learning_rate=OPTIM.lr, weight_decay=OPTIM.weight_decay, max_grad_norm=OPTIM.grad_clip,
            logging_steps=1, save_strategy="no", shuffle_dataset=False, disable_tqdm=True, seed=seed)
        rows: list[dict[str, float]] = []
        parts = {"generate_s": 0.0, "score_s": 0.0}

        class Interleave(transformers.TrainerCallback):
            def on_step_begin(self, *_, **__):
                parts.update(generate_s=0.0, score_s=0.0)
                self.start = time.perf_counter()

            def on_step_end(self, *_, **__):
                s = time.perf_counter() - self.start
                rows.append(dict(seconds=s, generate_s=parts["generate_s"],
                                 reward_ref_s=parts["score_s"] - parts["generate_s"], update_s=s - parts["score_s"]))
                between()

        gen = trl.GRPOTrainer(model=model_dir, reward_funcs=trl_ids_reward, args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": texts * steps}),
                              processing_class=word_level_tokenizer(vocab_size), callbacks=[Interleave()])
        _force_lengths_in_generate(gen.model, None if fixed else lengths_N, EOS_ID,
                                   [] if realised is None else realised)

        def timed(key: str, fn: Callable) -> Callable:
            def wrapper(*a, **kw):
                start = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    parts[key] += time.perf_counter() - start
            return wrapper
        gen._generate = timed("generate_s", gen._generate)
        gen._generate_and_score_completions = timed("score_s", gen._generate_and_score_completions)
        gen.train()
    return rows


def _quantiles(lengths) -> dict[str, float]:
    q = np.quantile(np.asarray(lengths), [0.1, 0.5, 0.9, 1.0])
    return dict(len_p10=q[0], len_p50=q[1], len_p90=q[2], len_max=q[3])


def bench_rl_step(preset: str = "tiny", dtype: str = "fp32", prompts: int = 8, group: int = 8, prompt_len: int = 32,
                  new_tokens: int = 128, beta: float = 0.05, repeats: int = 3, trl: bool = True, seed: int = 0,
                  workload: str = "fixed", layouts: tuple[str, ...] = ("packed",)) -> list[dict]:
    """Generated tokens/s (before EOS) of one RL step, sage_jax (each of `layouts`: the update on packed rows,
    impl "sage_jax", or on padded rows, "sage_jax_padded") vs TRL's GRPOTrainer (torch, CPU, fp32) on the same weights, prompts and completion lengths (workload
    "fixed": all new_tokens; "longtail": workloads.longtail_lengths); steps interleaved (ours run after each TRL step), the
    first of each excluded as warm-up."""
    cfg = preset_config(preset, dtype)
    params = jax.jit(model.init_params, static_argnums=0)(cfg, jax.random.key(seed))
    prompts_BxP = np.random.default_rng(seed).integers(2, cfg.vocab_size, (prompts, prompt_len))
    lengths_N = workloads.workload_lengths(workload, prompts * group, new_tokens, seed)
    ours = {"sage_jax" if layout == "packed" else "sage_jax_padded": _sage_rl_runner(cfg, params, prompts_BxP, group, lengths_N, beta, seed,
                                                  packed=layout == "packed") for layout in layouts}
    peak_fn, peak_flops = matmul_peak_fn(dtype)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ours}
    peak_s: list[float] = []
    trl_lengths: list = []

    def after_trl_step() -> None:  # our steps, then the matmul peak under the same load
        for name, run in ours.items():
            runs[name].append(run())
        start = time.perf_counter()
        jax.block_until_ready(peak_fn())
        peak_s.append(time.perf_counter() - start)

    load_before = os.getloadavg()[0]
    if trl:
        with tempfile.TemporaryDirectory() as model_dir:
            model.save_hf(model_dir, preset_config(preset, "fp32"), params)
            runs["trl"] = _trl_interleaved(model_dir, cfg.vocab_size, prompts_BxP, group, lengths_N, beta,
                                           repeats + 1, after_trl_step, seed, trl_lengths)
    else:
        for _ in range(repeats + 1):
            after_trl_step()
    tokens = int((lengths_N - (lengths_N < new_tokens)).sum())  # generated tokens before EOS
    peak = peak_flops / statistics.median(peak_s[1:] or peak_s)
    flops = rl_step_flops(cfg, prompts, group, prompt_len, new_tokens) if workload == "fixed" else None
    out = []
    for impl, rs in runs.items():
        rs = rs[1:] or rs  # drop the warm-up step (compilation, first-call set-up)
        row = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        realised = trl_lengths[-1] if impl == "trl" and trl_lengths else lengths_N  # one step's rows
        out.append(dict(preset=preset, dtype=dtype if impl != "trl" else "fp32", impl=impl, workload=workload,
                        prompts=prompts, group=group, new_tokens=new_tokens, tokens_per_s=tokens / row["seconds"],
                        **_quantiles(realised), **row))
        if flops:
            out[-1].update(model_gflops=flops / 1e9, gflops_per_s=flops / row["seconds"] / 1e9,
                           peak_gflops_per_s=peak / 1e9, frac_of_peak=flops / row["seconds"] / peak,
                           at_peak_s=flops / peak)
    by = {r["impl"]: r for r in out}
    for r in out:
        if "trl" in by and r["impl"] != "trl":
            r["vs_trl"] = r["tokens_per_s"] / by["trl"]["tokens_per_s"]
        if r["impl"] == "sage_jax" and "sage_jax_padded" in by:
            r["vs_padded"] = r["tokens_per_s"] / by["sage_jax_padded"]["tokens_per_s"]
    if flops and "trl" in by:
        by["trl"]["ceiling_vs_trl"] = by["trl"]["seconds"] / by["trl"]["at_peak_s"]
    print_table(out, [("impl", ""), ("workload", ""), ("new_tokens", "d"), ("len_p50", ".0f"), ("len_p90", ".0f"),
                      ("len_max", ".0f"), ("padded_frac", ".3f"), ("seconds", ".2f"), ("tokens_per_s", ".1f"),
                      ("vs_trl", ".2f"), ("vs_padded", ".2f"), ("generate_s", ".2f"), ("reward_s", ".3f"),
                      ("ref_s", ".2f"), ("reward_ref_s", ".2f"), ("update_s", ".2f"), ("frac_of_peak", ".2f"),
                      ("at_peak_s", ".2f"), ("ceiling_vs_trl", ".2f")])
    print(f"{preset} preset, {prompts} prompts x {group} samples; padded_frac: share of the positions the reference "
          "pass and the update compute on that hold no token; tokens: generated before EOS; 1-min load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    if flops:
        print(f"at_peak_s: the step's model FLOPs ({flops / 1e9:.0f} GFLOP: sampling, reference forward, policy "
              "forward + backward) at the jitted matmul peak timed after each step; ceiling_vs_trl: TRL's step over "
              "that, the most any implementation at this machine's matmul peak could reach against it")
    return out


def rl_step_flops(cfg: model.ModelConfig, prompts: int, group: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of one RL step as bench_rl_step runs it: generate (decode_flops), the reference forward (a third
    of train_flops) and the policy update (train_flops), on prompts x group rows of bucketed prompt + new tokens."""
    rows, P = prompts * group, sampler.prompt_bucket(prompt_len)
    return decode_flops(cfg, prompts, group, prompt_len, new_tokens) + (4 / 3) * train_flops(cfg, rows, P, new_tokens)


@register("rl_step")
def _rl_step_mode(args: argparse.Namespace) -> list[dict]:
    group = getattr(args, "group", 8)
    if args.batch % group:
        raise ValueError(f"--batch {args.batch} rows must be a multiple of --group {group} (rows = prompts x group)")
    layouts = ("packed", "padded") if getattr(args, "layout", "packed") == "both" else (args.layout,)
    return [r for p in _presets(args.preset) for r in bench_rl_step(
        p, args.dtype, args.batch // group, group, args.prompt_len, args.new_tokens, repeats=args.repeats,
        trl=not getattr(args, "no_trl", False), workload=getattr(args, "workload", "fixed"), layouts=layouts)]


# --------------------------------------------------------------------------------------------------- memory

def _logprob_losses(cfg: model.ModelConfig, chunk: int) -> dict[str, Callable]:
    """Scalar losses of (hidden [B,T,D], unembed [D,V], targets [B,T]) using both log-probs and entropies."""
    def chunked(h_BxTxD, w_DxV, t_BxT):
        logp, ent = model.logprobs_entropy_from_hidden(cfg, {"lm_head": w_DxV}, h_BxTxD, t_BxT, chunk=chunk)
        return -(logp.mean() + 0.01 * ent.mean())

    def naive(h_BxTxD, w_DxV, t_BxT):
        logits_BxTxV = jnp.einsum("btd,dv->btv", h_BxTxD, w_DxV, preferred_element_type=jnp.float32)
        logp_all = jax.nn.log_softmax(logits_BxTxV, axis=-1)
        logp = jnp.take_along_axis(logp_all, t_BxT[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return -(logp.mean() + 0.01 * ent.mean())
    return {"naive": naive, f"chunked_{chunk}": chunked}


def bench_memory(vocab: int = 152064, seq: int = 4096, hidden_sizes=(896, 3584), batches=(1, 4), chunks=(128, 512),
                 dtype: str = "fp32") -> list[dict]:
    """Peak temporary memory (XLA memory_analysis of the compiled program; nothing is run) of value_and_grad, w.r.t.
    hidden and unembedding, of a loss on log-probs + entropies: the full [B,T,V] fp32 logits vs chunks of positions."""
    GiB = 2.0 ** 30
    out = []
    for D in hidden_sizes:
        cfg = model.ModelConfig(vocab_size=vocab, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                                intermediate_size=1, tie_embeddings=False, compute_dtype=DTYPES[dtype])
        for B in batches:
            args = (jax.ShapeDtypeStruct((B, seq, D), DTYPES[dtype]), jax.ShapeDtypeStruct((D, vocab), DTYPES[dtype]),
                    jax.ShapeDtypeStruct((B, seq), jnp.int32))
            losses: dict[str, Callable] = {}
            for c in chunks:
                losses |= _logprob_losses(cfg, c)
            naive = None
            for impl, loss in losses.items():
                mem = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
                row = dict(hidden=D, batch=B, seq=seq, vocab=vocab, dtype=dtype, impl=impl,
                           temp_gib=mem.temp_size_in_bytes / GiB, args_gib=mem.argument_size_in_bytes / GiB,
                           output_gib=mem.output_size_in_bytes / GiB, logits_gib=B * seq * vocab * 4 / GiB)
                naive = row if impl == "naive" else naive
                row["naive_over_this"] = naive["temp_gib"] / row["temp_gib"]
                out.append(row)
    print_table(out, [("hidden", "d"), ("batch", "d"), ("seq", "d"), ("vocab", "d"), ("impl", ""),
                      ("temp_gib", ".2f"), ("args_gib", ".2f"), ("output_gib", ".2f"), ("logits_gib", ".2f"),
                      ("naive_over_this", ".1f")])
    return out


@register("memory")
def _memory_mode(args: argparse.Namespace) -> list[dict]:
    return bench_memory(dtype=args.dtype)


# --------------------------------------------------------------------------------------------------- scaling

def bench_scaling(preset: str = "tiny", dtype: str = "fp32", batches=(1, 4, 16, 64), lengths=(32, 64, 128, 256, 512),
                  fixed_batch: int = 16, fixed_len: int = 128, prompt_len: int = 32, repeats: int = 3,
                  plot: str | None = None, seed: int = 0) -> list[dict]:
    """Tokens/s of sampler.generate (generated tokens, temperature 1, forced length) and of the train step (all
    prompt + completion tokens) vs batch at `fixed_len` new tokens, and vs new tokens at `fixed_batch` rows."""
    cfg = preset_config(preset, dtype)
    params = jax.jit(model.init_params, static_argnums=0)(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    points = sorted({(b, fixed_len) for b in batches} | {(fixed_batch, n) for n in lengths})
    fns, tokens = {}, {}
    for b, n in points:
        prompts = rng.integers(1, cfg.vocab_size, (b, prompt_len)).tolist()
        fns[("sampler", b, n)] = lambda p=prompts, n=n: sampler.generate(cfg, params, p, n, temperature=1.0,
                                                                         eos_ids=(), seed=seed).tokens
        fns[("train_step", b, n)] = _train_runner(cfg, b, prompt_len, n, seed)[0]
        tokens[("sampler", b, n)], tokens[("train_step", b, n)] = b * n, b * (prompt_len + n)
    times = interleaved_seconds(fns, repeats)
    out = []
    for (kind, b, n), t in times.items():
        s = statistics.median(t)
        for sweep in (["batch"] if n == fixed_len else []) + (["length"] if b == fixed_batch else []):
            out.append(dict(preset=preset, dtype=dtype, kind=kind, sweep=sweep, batch=b, prompt_len=prompt_len,
                            new_tokens=n, seconds=s, tokens_per_s=tokens[(kind, b, n)] / s))
    out.sort(key=lambda r: (r["sweep"], r["kind"], r["batch"], r["new_tokens"]))
    print_table(out, [("kind", ""), ("sweep", ""), ("batch", "d"), ("new_tokens", "d"), ("seconds", ".3f"),
                      ("tokens_per_s", ".0f")])
    if plot:
        plot_scaling(out, plot)
    return out


def plot_scaling(rows: list[dict], path: str) -> None:
    """Two panels: tokens/s vs batch, tokens/s vs new tokens; one line per kind."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = {"sampler": "sampler (generated tokens/s)", "train_step": "train step (prompt+completion tokens/s)"}
    for ax, sweep, key, xlabel in ((axes[0], "batch", "batch", "batch (rows)"),
                                   (axes[1], "length", "new_tokens", "new tokens (completion length)")):
        for kind, label in labels.items():
            pts = sorted((r[key], r["tokens_per_s"]) for r in rows if r["kind"] == kind and r["sweep"] == sweep)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        fixed = next((r for r in rows if r["sweep"] == sweep), None)
        detail = f"{fixed['new_tokens']} new tokens" if sweep == "batch" and fixed else \
            f"batch {fixed['batch']}" if fixed else ""
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="tokens / s", title=f"vs {sweep} ({detail})")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    first = rows[0] if rows else {}
    fig.suptitle(f"{first.get('preset', '')} preset, {first.get('dtype', '')}, prompt {first.get('prompt_len', '')} "
                 f"tokens, CPU ({os.cpu_count()} cores)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@register("scaling")
def _scaling_mode(args: argparse.Namespace) -> list[dict]:
    return bench_scaling("tiny" if args.preset == "both" else args.preset, args.dtype, repeats=args.repeats,
                         plot=getattr(args, "plot", None))


# --------------------------------------------------------------------------------------------------- entry point

def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m sage_jax.bench_train", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=list(MODES))
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small", "both"])
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=64, help="rows = prompts x group")
    parser.add_argument("--group", type=int, default=8, help="rl_step: samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128, help="completion length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ablate", action="store_true", help="train_step: also time each of ABLATIONS")
    parser.add_argument("--no-trl", action="store_true", help="rl_step: our side only")
    parser.add_argument("--plot", default=None, help="scaling: write the two-panel PNG here")
    parser.add_argument("--sizes", default="1024,2048", help="matmul: square sizes")
    parser.add_argument("--workload", default="fixed", choices=["fixed", "longtail"],
                        help="rl_step: every completion --new-tokens long, or long-tailed lengths up to it")
    parser.add_argument("--layout", default="packed", choices=["packed", "padded", "both"],
                        help="rl_step: our reference pass and update on packed or padded rows")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write the rows (and their ratios) as JSON to PATH (no PATH: one line on stdout)")
    args = parser.parse_args(argv)
    rows = MODES[args.mode](args)
    if args.json:
        write_json(args.json, {args.mode: rows})
    return rows


def write_json(path: str, results: dict[str, list[dict]]) -> None:
    """{"modes": {mode: rows}, "load_avg_1min", "cores"} to path ("-": one line on stdout)."""
    payload = {"modes": results, "load_avg_1min": os.getloadavg()[0], "cores": os.cpu_count()}
    text = json.dumps(payload, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    if path == "-":
        print(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")


if __name__ == "__main__":
    main()
