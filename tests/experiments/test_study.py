"""The study harness (sage_jax.experiments.study) with both settings files: configs/smollm2_arms.py and
configs/countdown_arms.py. Fake result files stand in for runs; the committed records of both studies re-render
their committed numbers; a tiny countdown study runs end to end; the one run on the real SmolLM2 is marked slow."""

import json
import math
import os
import re
import shutil
import tarfile
import types
from collections import Counter

import pytest

from sage_jax.experiments import regime, report, reproduce, runs, smollm2_study, study
from sage_jax.experiments.stats import fmt
from sage_jax.run import config as config_lib
from tests.experiments.test_report import fake

SMOL = runs.settings("configs/smollm2_arms.py")
COUNTDOWN = runs.settings("configs/countdown_arms.py")
ARMS = ("base", "grpo", "branch", "nokl", "top_entropy")


def _cpu(preset="study"):
    return runs.flat(config_lib.load("configs/smollm2_cpu.py" + (":quick" if preset == "quick" else "")).to_dict())


# --------------------------------------------------------------------------------------------------- settings

@pytest.mark.parametrize("arm", ARMS)
def test_each_smollm2_arm_differs_from_smollm2_cpu_only_where_intended(arm):
    cpu, mine = _cpu(), runs.flat(config_lib.load(f"configs/smollm2_arms.py:{arm}").to_dict())
    intended = {**SMOL.STUDY, **SMOL.REGIME, **SMOL.ARMS[arm]}
    changed = {k for k, v in mine.items() if cpu.get(k, "<absent>") != v}
    expected = {k for k, v in intended.items() if cpu.get(k, "<absent>") != (list(v) if isinstance(v, tuple) else v)}
    assert changed == expected | {k for k in mine if k.startswith("experiment.")}  # + the harness's own section
    assert mine["eval.problems"] >= 96 and mine["data.num_eval"] >= mine["eval.problems"] and mine["eval.n"] >= 32
    assert not mine["eval.at_start"] and not mine["eval.at_end"]  # the harness evaluates, not the trainer
    assert mine["loss.kl_estimator"] == ("none" if arm == "nokl" else "k3")
    assert mine["loss.guide"] == ("branch" if arm == "branch" else "none")
    assert mine["experiment.rl"] == (arm != "base")


def test_smollm2_branch_is_the_authors_form_with_tau_from_the_base():
    c = config_lib.load("configs/smollm2_arms.py:branch")
    assert (c.loss.guide, c.loss.kl_estimator, c.loss.beta, c.loss.gamma, c.loss.q_min, c.loss.q_max) == (
        "branch", "k3", 0.05, 0.3, 0.6, 1.4)
    assert c.experiment.tau_quantile == 0.8 and not c.loss.kl_in_reward
    quick = runs.flat(config_lib.load("configs/smollm2_arms.py:grpo,quick").to_dict())
    assert quick["train.steps"] == _cpu("quick")["train.steps"] == 2 and quick["eval.n"] == 4


@pytest.mark.parametrize("arg", ["nope", "grpo,quik", "quik", "grpo,study,x"])
def test_an_unknown_arm_or_preset_is_an_error(arg):
    with pytest.raises(config_lib.ConfigError, match="unknown"):
        config_lib.load(f"configs/smollm2_arms.py:{arg}")


@pytest.mark.parametrize("settings", ["configs/smollm2_arms.py", "configs/countdown_arms.py"])
@pytest.mark.parametrize("flag, match", [("--arms=grpo,nope", "unknown nope"), ("--preset=huge", "unknown")])
def test_unknown_arms_and_presets_on_the_command_line(tmp_path, settings, flag, match):
    with pytest.raises(ValueError, match=match):
        study.main(["--settings", settings, "--out", str(tmp_path), flag])
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_a_settings_file_without_a_study_or_a_sweep_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="configs/cpu_demo.py is not a study's settings file"):
        study.main(["--settings", "configs/cpu_demo.py", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--sweep: .*smollm2_arms.py defines no sweep"):
        study.main(["--settings", "configs/smollm2_arms.py", "--out", str(tmp_path), "--sweep", "--report-only"])


def test_smollm2_seeds_per_arm_and_the_work_list():
    seeds = SMOL.SEEDS_PER_ARM
    assert seeds["grpo"] >= 5 and seeds["branch"] >= 5 and min(seeds.values()) >= 3 and set(seeds) == set(ARMS)
    assert seeds["base"] == max(seeds.values())  # every run pairs with a base evaluation of its seed
    jobs = study.make_jobs(SMOL, list(ARMS), None, "study", [], "/o", "/w", tau=0.91)
    assert len(jobs) == sum(seeds.values())
    assert [(j.arm, j.seed) for j in jobs[:5]] == [(a, 0) for a in ARMS]  # seed-major
    assert jobs[0].path == "/o/runs/base/seed0.json" and jobs[0].workdir.startswith("/w/runs/base/seed0-")
    branch = [j for j in jobs if j.arm == "branch"]
    assert all(j.config.loss.tau == 0.91 for j in branch)
    assert all(j.config.loss.tau == 1.2 for j in jobs if j.arm == "grpo")  # unused without the guide
    assert study.make_jobs(SMOL, ["branch"], 1, "study", [], "/o", "/w", tau=0.5)[0].fingerprint != \
        branch[0].fingerprint  # tau is part of Branch's settings
    with pytest.raises(ValueError, match="entropy profile"):
        study.make_jobs(SMOL, ["branch"], 1, "study", [], "/o", "/w", tau=None)


def test_countdown_seeds_per_arm_and_the_sweep_cross():
    seeds = COUNTDOWN.SEEDS_PER_ARM
    assert all(seeds[a] >= 10 for a in ("grpo", "grpo_branch", "grpo_branch_paper", "grpo_rkl"))
    assert seeds["base"] == 1 and set(seeds) <= set(COUNTDOWN.ARMS)  # one SFT model, evaluated once
    jobs = study.make_jobs(COUNTDOWN, list(seeds), None, "study", [], "/r", "/w", tau=0.5)
    count = Counter(j.arm for j in jobs)
    assert count["grpo_branch_paper"] == 10 and count["grpo_entropy"] == 5 and count["base"] == 1
    assert all(j.config.loss.tau == 0.5 for j in jobs if j.config.loss.guide == "branch")
    cells = study.sweep_jobs(COUNTDOWN, "study", None, [], "/r", "/w", 0.5, [0.4, 0.5, 0.6])
    assert {os.path.dirname(j.label) for j in cells} == {f"sweep/gamma{g}_tau{t}" for g, t in (
        (0.1, 0.5), (0.3, 0.5), (1.0, 0.5), (0.3, 0.4), (0.3, 0.6))}  # one factor at a time through (0.3, tau)
    centre = [j for j in cells if j.label.startswith("sweep/gamma0.3_tau0.5/")]
    paper = {j.seed: j for j in jobs if j.arm == "grpo_branch_paper"}
    assert all(j.fingerprint == paper[j.seed].fingerprint for j in centre)  # the arm's own runs serve it


# --------------------------------------------------------------------------------------------------- resume

def test_finished_files_are_skipped_and_a_mismatched_fingerprint_is_not(tmp_path, monkeypatch):
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    grpo, nokl = study.make_jobs(SMOL, ["grpo", "nokl"], 1, "study", [], out, work, tau=None)
    runs.write_result(grpo.path, fake("grpo", 0, grpo.fingerprint, [1, 2]))
    runs.write_result(nokl.path, fake("nokl", 0, "made-with-other-settings", [1, 2]))
    ran = []
    monkeypatch.setattr(study, "run_job", lambda mod, job, task, base, command: ran.append(job.label))
    session = types.SimpleNamespace(mod=SMOL, task=None, base_for=lambda config: None, command="cmd", results=out,
                                    check=lambda config: None)
    study.run_all([grpo, nokl], session)
    assert ran == ["runs/nokl/seed0"]
    assert not os.path.exists(os.path.join(nokl.workdir, "claim.pid"))  # released after the run
    # a result file elsewhere with the same settings (the regime's GRPO) is adopted, not rerun
    os.remove(grpo.path)
    runs.write_result(str(tmp_path / "out" / "regime" / "c" / "grpo" / "seed0.json"),
                      fake("grpo", 0, grpo.fingerprint, [3, 4]))
    study.run_all([grpo], session)
    assert ran == ["runs/nokl/seed0"] and runs.read_result(grpo.path)["eval"]["heldout"]["correct"] == [3, 4]
    # one session holds one model and one problem set: a run that changes either is refused
    real = study.Session(SMOL, grpo.config, "cmd", out, work)
    real.check(runs.load_config(SMOL, "nokl", "study", seed=3, settings_={"optim.lr": 1e-3}))
    with pytest.raises(ValueError, match="problem sets"):
        real.check(runs.load_config(SMOL, "grpo", "study", settings_={"data.num_train": 500}))


def test_a_rerun_of_a_finished_study_loads_nothing_and_reports(tmp_path, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    config = runs.load_config(SMOL, "branch", "study")
    runs.write_result(str(out / "runs" / "base" / "entropy.json"),
                      {"fingerprint": runs.entropy_fingerprint(SMOL, config), "mean": 0.7, "tokens": 100,
                       "grid": [i / 100 for i in range(101)]})  # quantile q at q nats: tau = 0.8
    for j in study.make_jobs(SMOL, ["base", "grpo", "branch"], 2, "study", [], str(out), str(work), tau=0.8):
        runs.write_result(j.path, fake(j.arm, j.seed, j.fingerprint, [1 + j.seed, 2],
                                       q=1.06 if j.arm == "branch" else None))
    refuse = lambda *a, **k: pytest.fail("a finished study must not load the model or run anything")
    monkeypatch.setattr(study, "run_job", refuse)
    monkeypatch.setattr(study.measure, "load_base", refuse)
    smollm2_study.main(["--out", str(out), "--work", str(work), "--arms", "base,grpo,branch", "--seeds", "2"])
    text = (out / "RESULTS.md").read_text()
    assert "| branch | 2 |" in text and "| base | 2 |" in text  # tau 0.8 from the committed profile: nothing ran


def test_the_old_countdown_commands_are_aliases(monkeypatch):
    argv = reproduce.translated(["--budget", "study", "--arms", "STUDY", "--sweep", "--out", "O", "--records", "R",
                                 "--report-only"])
    assert argv[:2] == ["--settings", str(runs.ROOT / "configs" / "countdown_arms.py")]
    assert argv[2:] == ["--preset", "study", "--sweep", "--out", "O", "--results", "R/study", "--report-only"]
    assert reproduce.translated(["--tiny", "--arms", "grpo"])[2:] == ["--preset", "tiny", "--arms", "grpo"]
    called = []
    monkeypatch.setattr(study, "main", lambda argv, command, shown: called.append((argv, command, shown)))
    regime.main(["--out", "docs/results/study_countdown/regime.md", "--records", "R", "--budget", "study"])
    (argv, command, shown), = called
    assert argv[:2] == ["--regime", "--regime-all"] and command == "python -m sage_jax.experiments.regime"
    assert argv[argv.index("--out") + 1] == str(runs.ROOT / "docs/results/study_countdown")
    assert argv[argv.index("--results") + 1] == "R/study" and shown[0] == "--out"


# --------------------------------------------------------------------------------------------------- committed

def _cells(markdown: str) -> dict[tuple[str, str, str], str]:
    """{(a table's first header, row, column): cell} of every markdown table; keys found twice are left out."""
    lines, found, seen = markdown.splitlines(), {}, Counter()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.match(r"^\|\s*-", lines[i + 1]):
            head = [c.strip() for c in line.strip("|").split("|")]
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                cells = [c.strip() for c in row.strip("|").split("|")]
                name = cells[0].replace("base (SFT)", "base")
                for column, cell in zip(head[1:], cells[1:]):
                    if not (name == "base" and column == "seeds"):
                        seen[head[0], name, column] += 1
                        found[head[0], name, column] = cell
    return {k: v for k, v in found.items() if seen[k] == 1}


def _same_numbers(old: object, new: object, where: str = "") -> list[str]:
    if isinstance(old, dict):
        return [w for k in old for w in (_same_numbers(old[k], new[k], f"{where}/{k}") if k in new else [where + k])]
    if isinstance(old, list):
        return [f"{where}: length"] if len(old) != len(new) else [
            w for i, (a, b) in enumerate(zip(old, new)) for w in _same_numbers(a, b, f"{where}[{i}]")]
    if isinstance(old, float):
        return [] if isinstance(new, (int, float)) and math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-12) else [where]
    return [] if old == new else [where]


@pytest.mark.parametrize("name", ["study_countdown", "smollm2_study"])
def test_committed_records_rerender_the_committed_numbers(tmp_path, monkeypatch, name):
    """Both studies' reports from their committed result files alone, with today's settings files: a setting added
    to the configs without its entry in runs.INERT changes the fingerprints and fails this test."""
    monkeypatch.setattr(report, "figures", lambda *a: [])  # the numbers are the point (figures: test_report.py)
    committed = runs.ROOT / "docs" / "results" / name
    out = tmp_path / "out"
    if name == "study_countdown":
        with tarfile.open(committed / "runs.tar.xz") as archive:
            archive.extractall(tmp_path)
        reproduce.main(["--budget", "study", "--arms", "STUDY", "--sweep", "--out", str(out), "--records",
                        str(tmp_path / "runs"), "--report-only"])  # the command its RESULTS.md gives
    else:
        shutil.copytree(committed, out)
        smollm2_study.main(["--out", str(out), "--report-only"])
        old = json.loads((committed / "results.json").read_text())
        new = json.loads((out / "results.json").read_text())
        assert not _same_numbers({k: old[k] for k in ("per_seed", "aggregate", "n", "comparisons", "warnings")}, new)
    old, new = _cells((committed / "RESULTS.md").read_text()), _cells((out / "RESULTS.md").read_text())
    common = set(old) & set(new)
    assert [(k, old[k], new[k]) for k in sorted(common) if old[k] != new[k]] == []
    assert len(common) >= (330 if name == "study_countdown" else 100)
    arms = json.loads((out / "results.json").read_text())["per_seed"]
    assert sum(len(by) for by in arms.values()) == (76 if name == "study_countdown" else 21)  # every run
    # the regime search from the same files: the same candidates, pass@1 gains, verdicts and choice
    study.main(["--settings", f"configs/{'countdown' if name == 'study_countdown' else 'smollm2'}_arms.py",
                "--preset", "study", "--regime", "--regime-all", "--report-only", "--out", str(tmp_path / "regime"),
                "--results", str(tmp_path / "runs" / "study" if name == "study_countdown" else out)])
    old, new = (json.loads((where / "regime.json").read_text()) for where in (committed, tmp_path / "regime"))
    assert new["selected"] == old["selected"] and list(new["candidates"]) == list(old["candidates"])
    for candidate, was in old["candidates"].items():
        now = new["candidates"][candidate]
        gain = was.get("gain") or [was["d_pass@1"]["mean"], was["d_pass@1"]["half"]]
        assert [now["d_pass@1"]["mean"], now["d_pass@1"]["half"]] == pytest.approx(gain, rel=1e-9)
        assert now["kept"] == was["kept"] and now["seeds"] == was["seeds"]
    if name == "study_countdown":  # the sweep's table: | gamma | tau | seeds | pass@1 | pass@256 | ...
        sweep = json.loads((out / "results.json").read_text())["sweep"]
        rows = re.findall(r"^\| ([\d.]+) \| ([\d.]+) \| 5 \| ([^|]+) \| ([^|]+) \|",
                          (committed / "RESULTS.md").read_text(), re.M)
        assert len(rows) == len(sweep) == 5  # 4 cells + the arm's own point
        for gamma, tau, p1, p256 in rows:
            cell = sweep[f"gamma{gamma}_tau{tau}"]
            assert (fmt(*cell["countdown/pass@1"]), fmt(*cell["countdown/pass@256"])) == (p1.strip(), p256.strip())


# --------------------------------------------------------------------------------------------------- end to end

def test_tiny_countdown_study_runs_resumes_and_reports(tmp_path):
    """The SFT base, GRPO and the paper-form Branch with tau from the base's entropies, and the sweep's cross, in
    seconds per run (conftest's compile cache); then a rerun that skips everything."""
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--settings", "configs/countdown_arms.py", "--preset", "tiny", "--out", str(out), "--work", str(work),
            "--arms", "base,grpo,grpo_branch_paper", "--sweep"]
    study.main(args)
    text = (out / "RESULTS.md").read_text()
    for arm in ("base", "grpo", "grpo_branch_paper"):
        assert f"| {arm} | 1 |" in text, arm
    assert "## Branch sweep" in text and "## Guide activity" in text and "RL-prompt pass@1" in text
    for png in ("pass_at_k_countdown.png", "pass_at_k_countdown_ood.png", "training_curves.png"):
        assert (out / png).stat().st_size > 1000, png
    results = json.loads((out / "results.json").read_text())
    assert len(results["aggregate"]["grpo"]["countdown/curve"][0]) == 8  # pass@k for k = 1..n
    tau = runs.read_result(str(out / "runs" / "grpo_branch_paper" / "seed0.json"))["tau"]
    entropy = json.loads((out / "runs" / "base" / "entropy.json").read_text())
    assert tau == study.measure.tau_at(entropy, 0.8) and len(results["sweep"]) == 3  # gammas 0.3, 1.0; tau q 0.5
    paper = runs.read_result(str(out / "runs" / "grpo_branch_paper" / "seed0.json"))
    assert all(v is not None for k in ("q_active", "q_mean") for v in paper["curves"][k])
    assert paper["times"]["train_wall_s"] > 0 and paper["weights"] and os.path.getsize(
        out / "runs" / "grpo" / "seed0.json") < 60_000
    stamp = (out / "runs" / "grpo" / "seed0.json").stat().st_mtime_ns
    study.main(args)  # everything finished: skipped
    assert (out / "runs" / "grpo" / "seed0.json").stat().st_mtime_ns == stamp
    # the regime search: round1's GRPO seed 0 is the study's run (same settings); the skewed candidate trains a
    # second SFT base (other demonstration weights) and starts its runs from it
    study.main(args[:6] + ["--work", str(work), "--regime", "--regime-all", "--seeds", "2", "--candidates",
                           "round1,steps200_skew"])
    found = json.loads((out / "regime.json").read_text())["candidates"]
    assert [found[c]["seeds"] for c in ("round1", "steps200_skew")] == [2, 2]
    assert all(r["split"] == "countdown_rl" and r["reason"].split(":")[0] in ("kept", "dropped")
               for r in found.values())
    assert len(list((work / "base").glob("sft-*"))) == 2
    weights = {runs.read_result(str(p))["weights"] for p in (out / "regime").glob("*/grpo/seed1.json")}
    assert len(weights) == 2


@pytest.mark.slow
def test_quick_smollm2_study_on_the_real_model_and_its_resume(tmp_path):
    """Base, GRPO and Branch, 1 seed each, then a resume (16.5 min under pytest on the shared 2-core machine)."""
    from tests.helpers_smollm2 import smollm2_hf_dir
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--out", str(out), "--work", str(work), "--quick", "--arms", "base,grpo,branch", "--seeds", "1",
            f"--config.model.path={smollm2_hf_dir()}"]
    smollm2_study.main(args)
    for arm in ("base", "grpo", "branch"):
        rec = runs.read_result(str(out / "runs" / arm / "seed0.json"))
        assert rec["n"] == 4 and len(rec["eval"]["heldout"]["correct"]) == 4
    branch = runs.read_result(str(out / "runs" / "branch" / "seed0.json"))
    assert branch["guide"]["q_mean"] > 1.0 and 0 < branch["guide"]["q_active"] < 1 and branch["tau"] > 0
    assert (out / "RESULTS.md").exists() and (out / "pass_at_k.png").stat().st_size > 1000
    assert math.isfinite(branch["times"]["train_cpu_s"])
    # a run stopped before its result file was written resumes from its workdir: the final checkpoint (no new
    # step) and the evaluation's samples (the same samples)
    grpo = runs.read_result(str(out / "runs" / "grpo" / "seed0.json"))
    (metrics,) = (work / "runs" / "grpo").glob("seed0-*/metrics.jsonl")
    lines = metrics.read_text().count("\n")
    os.remove(out / "runs" / "grpo" / "seed0.json")
    smollm2_study.main(args)
    again = runs.read_result(str(out / "runs" / "grpo" / "seed0.json"))
    assert again["eval"] == grpo["eval"] and again["curves"]["step"] == grpo["curves"]["step"]
    assert again["fingerprint"] == grpo["fingerprint"] and metrics.read_text().count("\n") == lines  # no new step


@pytest.mark.slow  # ~100 s on 2 cores: the tool arm's sampler programs and the sandbox's evaluation
def test_tiny_tool_study_runs_with_one_sft_base_and_reports(tmp_path):
    """configs/tools_arms.py end to end: one SFT base for all four arms (the base arms differ in their evaluation's
    tools only), the tool arm trained and evaluated with the Python tool, the report's tool columns."""
    out, work = tmp_path / "out", tmp_path / "work"
    study.main(["--settings", "configs/tools_arms.py", "--preset", "tiny", "--out", str(out), "--work", str(work)])
    assert len(list((work / "base").glob("sft-*"))) == 1
    records = {arm: runs.read_result(str(out / "runs" / arm / "seed0.json"))
               for arm in ("base", "base_tool", "no_tool", "tool")}
    assert len({r["weights"] for r in records.values()}) == 1
    assert "tool_rows" in records["tool"]["eval"]["heldout"] and "tool_rows" not in records["no_tool"]["eval"][
        "heldout"]
    assert any(v is not None for v in records["tool"]["curves"]["tool_rows"])
    text = (out / "RESULTS.md").read_text()
    assert "| tool | 1 |" in text and "samples calling the tool" in text
