"""python -m sage_jax.evaluate, in process, on a tiny random HF Qwen2 and on a tiny countdown training workdir."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from sage_jax.eval import passk as evaluation
from sage_jax.run import cli
from sage_jax import evaluate
from sage_jax.eval import offline as ev
from sage_jax.models import build
from tests.helpers_hf import tiny_hf_model, tiny_tokenizer

PROBLEMS = {"What is 1 + 1?": "2", "What is 2 + 3?": "5", "What is 3 * 3?": "9"}
REAL_MAKE_GENERATE_FN = evaluation.make_generate_fn
FAST = ["--n", "4", "--k", "1,2,4", "--max-new-tokens", "8", "--batch-problems", "1", "--reward-workers", "0",
        "--dtype", "float32", "--no-progress"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    tiny_hf_model(path, vocab=320)  # the tiny tokenizer's ids go up to 319
    tiny_tokenizer(path)
    return path


def _write_set(folder: Path, problems: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    with open(folder / "test.jsonl", "w") as f:
        for q, a in problems.items():
            f.write(json.dumps({"problem": q, "answer": a}) + "\n")
    return folder


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory):
    return _write_set(tmp_path_factory.mktemp("data") / "tiny", PROBLEMS)


def _main(argv) -> int:
    with pytest.raises(SystemExit) as exit_info:
        cli.main_guard(lambda: evaluate.main([str(a) for a in argv]))
    return exit_info.value.code


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _spy_generate(monkeypatch, fail_on_call: int = 0):
    """Wraps the real sampler closure; records how many prompts each call got, optionally interrupts a call."""
    calls = []

    def make(*args, **kwargs):
        fn = REAL_MAKE_GENERATE_FN(*args, **kwargs)

        def generate_fn(prompts, n, pad_to=0):
            calls.append(len(prompts))
            if len(calls) == fail_on_call:
                raise KeyboardInterrupt
            return fn(prompts, n, pad_to)
        return generate_fn
    monkeypatch.setattr(evaluation, "make_generate_fn", make)
    return calls


def _cheap_plots(monkeypatch):
    monkeypatch.setattr(evaluation, "plot_pass_at_k", lambda curves, path, title="": Path(path).write_bytes(b"png"))


def _forbid_sampling(monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a finished evaluation must not load the model")
    monkeypatch.setattr(ev, "load_model", no_model)


def _check_consistent(out: Path, name: str, n: int, ks=(1, 2, 4)):
    records = _records(out / name / "samples.jsonl")
    results = json.loads((out / name / "results.json").read_text())
    for r in records:
        assert r["n"] == n and len(r["completions"]) == n == len(r["rewards"])
        assert r["num_correct"] == sum(x >= 1.0 for x in r["rewards"])
    for k in ks:
        expected = np.mean([evaluation.pass_at_k(n, r["num_correct"], k) for r in records])
        assert 0.0 <= results["pass_at_k"][str(k)] <= 1.0
        assert results["pass_at_k"][str(k)] == pytest.approx(expected)
    return records, results


def test_end_to_end_extend_interrupt_and_resume(hf_dir, tiny_set, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = ["--model", hf_dir, "--datasets", tiny_set, "--out", out, *FAST]
    real_plot, real_load_model = evaluation.plot_pass_at_k, ev.load_model
    _cheap_plots(monkeypatch)
    calls = _spy_generate(monkeypatch)
    assert _main([*argv, "--limit", "2"]) == 0
    assert calls == [1, 1] and len(_records(out / "tiny" / "samples.jsonl")) == 2

    calls.clear()  # a longer run only samples the problems it has not seen
    monkeypatch.setattr(evaluation, "plot_pass_at_k", real_plot)
    assert _main(argv) == 0
    assert calls == [1]
    records, results = _check_consistent(out, "tiny", n=4)
    assert [r["answer"] for r in records] == list(PROBLEMS.values()) and results["num_problems"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["datasets"]["tiny"]["pass@4"] == pytest.approx(results["pass_at_k"]["4"])
    assert summary["average"]["pass@1"] == pytest.approx(results["pass_at_k"]["1"])
    assert "| average |" in (out / "summary.md").read_text()
    for f in ("pass_at_k.png", "tiny/pass_at_k.png"):
        assert (out / f).read_bytes().startswith(b"\x89PNG"), f
    assert (out / "tiny" / "results.md").stat().st_size and (out / "eval_settings.json").stat().st_size

    before = (out / "tiny" / "samples.jsonl").read_bytes()
    _cheap_plots(monkeypatch)
    _forbid_sampling(monkeypatch)  # all done: nothing is sampled, the model is never loaded
    assert _main(argv) == 0
    assert (out / "tiny" / "samples.jsonl").read_bytes() == before
    monkeypatch.setattr(ev, "load_model", real_load_model)

    # Ctrl-C during the second batch, then rerun: only the two missing problems are sampled, and with the same keys
    out2 = tmp_path / "out2"
    argv2 = ["--model", hf_dir, "--datasets", tiny_set, "--out", out2, *FAST]
    calls = _spy_generate(monkeypatch, fail_on_call=2)
    assert _main(argv2) == 130
    assert len(_records(out2 / "tiny" / "samples.jsonl")) == 1
    calls = _spy_generate(monkeypatch)
    assert _main(argv2) == 0
    assert calls == [1, 1]
    assert [r["completions"] for r in _records(out2 / "tiny" / "samples.jsonl")] == [r["completions"] for r in records]


def test_pooled_scores_give_the_unbiased_pass_at_k(hf_dir, tiny_set, tmp_path, monkeypatch):
    """Canned completions with known correct counts, scored by a real worker process."""
    other = _write_set(tmp_path / "other", {"What is 10 - 4?": "6", "What is 7 + 7?": "14"})
    correct = {"What is 1 + 1?": 0, "What is 2 + 3?": 1, "What is 3 * 3?": 4, "What is 10 - 4?": 2, "What is 7 + 7?": 3}
    answers = {**PROBLEMS, "What is 10 - 4?": "6", "What is 7 + 7?": "14"}

    def make(cfg, params, decode, *args, **kwargs):
        def generate_fn(prompts, n, pad_to=0):
            out = []
            for p in prompts:
                q = next(q for q in correct if q in decode(p))
                out.append([f"so \\boxed{{{answers[q]}}}" if i < correct[q] else f"\\boxed{{{i + 100}}}"
                            for i in range(n)])
            return out
        return generate_fn
    monkeypatch.setattr(evaluation, "make_generate_fn", make)
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: (None, None))
    from sage_jax.rewards.pool import RewardPool
    batches, real_score = [], RewardPool.score

    def spy_score(self, completions, golds, *args):
        batches.append(len(completions))
        return real_score(self, completions, golds, *args)
    monkeypatch.setattr(RewardPool, "score", spy_score)
    out = tmp_path / "out"
    argv = ["--model", hf_dir, "--datasets", f"{tiny_set},{other}", "--out", out, *FAST, "--reward-workers", "1",
            "--batch-problems", "2"]
    assert _main(argv) == 0
    # one pool call per generated batch of 2 problems, each distinct completion scored once
    unique = {q: (correct[q] > 0) + 4 - correct[q] for q in correct}
    assert batches == [unique["What is 1 + 1?"] + unique["What is 2 + 3?"], unique["What is 3 * 3?"],
                       unique["What is 10 - 4?"] + unique["What is 7 + 7?"]]
    summary = json.loads((out / "summary.json").read_text())
    for name, qs in (("tiny", list(PROBLEMS)), ("other", ["What is 10 - 4?", "What is 7 + 7?"])):
        records, results = _check_consistent(out, name, n=4)
        assert [r["num_correct"] for r in records] == [correct[q] for q in qs]
        for k in (1, 2, 4):
            expected = np.mean([evaluation.pass_at_k(4, correct[q], k) for q in qs])
            assert summary["datasets"][name][f"pass@{k}"] == pytest.approx(expected)
    for k in (1, 2, 4):
        mean = (summary["datasets"]["tiny"][f"pass@{k}"] + summary["datasets"]["other"][f"pass@{k}"]) / 2
        assert summary["average"][f"pass@{k}"] == pytest.approx(mean)


def _countdown_workdir(workdir: Path) -> Path:
    """What trainer.run_rl leaves behind (run config, an RL checkpoint, hf_export), without training."""
    import jax
    from sage_jax.data import tasks
    from sage_jax.models import decoder as model
    from sage_jax.run import checkpoint, config as config_lib
    from sage_jax.training import state as train_state
    from sage_jax.run import metrics_log as slog
    config = config_lib.load("configs/tiny_test.py")
    cfg = build.model_config(config, vocab_size=tasks._CountdownTok().vocab_size)
    rng = np.random.default_rng(3)  # numpy init: compiling model.init_params costs more than this whole test
    params = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype),
                          jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0))))
    slog.MetricsLogger(workdir, config.to_dict(), use_tensorboard=False).close()
    tx, _ = train_state.make_optimizer(config.optim, 3)
    ckpt = checkpoint.Checkpointer(workdir / "rl")
    ckpt.save(1, jax.jit(lambda p: train_state.init_state(p, tx))(params), {"rl_step": 1})
    ckpt.close()
    model.save_hf(workdir / "hf_export", cfg, params)
    return workdir


def test_countdown_workdir_from_export_and_from_checkpoint(tmp_path, monkeypatch):
    workdir = _countdown_workdir(tmp_path / "run")
    common = ["--datasets", "countdown", "--limit", "2", *FAST]
    assert _main(["--model", workdir, *common]) == 0
    assert _main(["--model", workdir, "--step", "1", *common]) == 0
    exported, restored = (_check_consistent(workdir / "eval" / src, "countdown", n=4)[0] for src in
                          ("hf_export", "step1"))
    assert [r["completions"] for r in exported] == [r["completions"] for r in restored]  # same params, same keys
    settings = json.loads((workdir / "eval" / "step1" / "eval_settings.json").read_text())
    assert settings["task"] == "countdown" and settings["step"] == 1
    assert exported[0]["prompt"].endswith(":") and ">" in exported[0]["prompt"]  # countdown.prompt, no template

    # without hf_export the newest checkpoint is used: step 1 again, already evaluated
    shutil.rmtree(workdir / "hf_export")
    _forbid_sampling(monkeypatch)
    assert _main(["--model", workdir, *common]) == 0


def _error(capsys, argv) -> str:
    capsys.readouterr()
    assert _main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_errors_are_one_line_with_exit_code_2(hf_dir, tiny_set, tmp_path, capsys):
    assert "does not exist" in _error(capsys, ["--model", tmp_path / "nope", "--datasets", tiny_set])
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert "safetensors" in _error(capsys, ["--model", no_weights, "--datasets", tiny_set])
    assert "unknown dataset 'aime99'" in _error(capsys, ["--model", hf_dir, "--datasets", "math500,aime99"])
    assert "larger than --n 4" in _error(capsys, ["--model", hf_dir, "--datasets", tiny_set, "--n", "4", "--k",
                                                  "1,8"])
    assert "countdown" in _error(capsys, ["--model", hf_dir, "--datasets", tiny_set, "--task", "countdown"])
    out = tmp_path / "out"
    (out).mkdir()
    (out / ev.SETTINGS_FILE).write_text(json.dumps({"temperature": 0.6}))
    assert "temperature was 0.6" in _error(capsys, ["--model", hf_dir, "--datasets", tiny_set, "--out", out])


def test_names_tasks_and_rewards():
    assert ev.out_name("kk:people5") == "kk_people5" and ev.out_name("/data/sets/foo.jsonl") == "foo"
    assert ev.infer_task(None, ev.ModelSource("hf", Path(".")), ["countdown", "countdown_ood"]) == "countdown"
    assert ev.infer_task(None, ev.ModelSource("hf", Path(".")), ["kk:people3"]) == "kk"
    assert ev.infer_task(None, ev.ModelSource("hf", Path(".")), ["math500", "kk"]) == "math"
    assert [ev.reward_for(n, "math") for n in ("math500", "kk", "countdown_ood")] == ["math", "kk", "countdown"]
    assert [ev.reward_for(n, "kk") for n in ("math500", "kk:people3", "/d/kk.jsonl")] == ["math", "kk", "kk"]
    assert ev.split_name("kk:people5") == ("kk", "people5")
    assert ev.split_name("hf://org/x:cfg") == ("hf://org/x:cfg", "")
    assert ev.check_ks([4, 1, 4], 4) == [1, 4]


@pytest.mark.slow
def test_trained_countdown_workdir(tmp_path, request):
    """A real one-step training run evaluated from its workdir (hf_export, with the run's countdown sets)."""
    if not os.environ.get("SAGE_SLOW_TESTS") and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("about 90 s of training; run with -m slow or SAGE_SLOW_TESTS=1")
    from sage_jax.run import config as config_lib
    from sage_jax.training import trainer
    config = config_lib.load("configs/tiny_test.py", ["--config.train.steps=1", "--config.train.export_hf=true",
                                                     "--config.train.use_tensorboard=false"])
    trainer.run(config, str(tmp_path))
    assert _main(["--model", tmp_path, "--limit", "2", *FAST]) == 0  # the run's own held-out set (no OOD split here)
    summary = json.loads((tmp_path / "eval" / "hf_export" / "summary.json").read_text())
    assert set(summary["datasets"]) == {"countdown"}


def test_a_training_workdir_is_evaluated_with_its_own_sampling_and_sets():
    """evaluate --model WORKDIR: the run's eval.* sampling and data.eval sets unless flags say otherwise (it used to
    sample 3,072 tokens at T 1.0 on the math sets for a run that evaluated 40 tokens at T 0.7 on arith_words)."""
    from sage_jax import evaluate
    from sage_jax.data import word_problems
    from sage_jax.run import config as config_lib
    run_config = config_lib.load("configs/smollm2_cpu.py")
    args = evaluate.parse_args(["--model", "W"])
    assert ev.run_defaults(args, run_config) == ["arith_words"]
    assert (args.temperature, args.min_p, args.max_new_tokens, args.top_p) == (0.7, 0.1, 40, 1.0)
    args = evaluate.parse_args(["--model", "W", "--temperature", "1.0", "--datasets", "math500"])
    assert ev.run_defaults(args, run_config) == ["math500"] and args.temperature == 1.0 and args.min_p == 0.1
    args = evaluate.parse_args(["--model", "DIR"])
    assert ev.run_defaults(args, None) == ["aime24", "aime25", "amc23", "math500"] and args.max_new_tokens == 3072
    countdown = config_lib.load("configs/cpu_demo.py")
    assert ev.run_defaults(evaluate.parse_args(["--model", "W"]), countdown)[0] == "countdown"
    held_out = ev.load_examples("arith_words", "", 0, run_config, int(run_config.seed))
    train = word_problems.generate(run_config.data.num_train, run_config.seed)
    assert len(held_out) == run_config.data.num_eval and not {e.problem for e in held_out} & {e.problem for e in train}
    assert ev.reward_for("arith_words", "math") == "math"
