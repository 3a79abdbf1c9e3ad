"""Run once (issue 47): the two studies' committed records as result files of the one study harness
(sage_jax/experiments/study.py), each fingerprint checked under the rule that made it before it is replaced.

    PYTHONPATH=. python docs/results/convert_records.py countdown RUNS   # study_countdown/runs.tar.xz unpacked
    PYTHONPATH=. python docs/results/convert_records.py smollm2 docs/results/smollm2_study

countdown: RUNS/study/{base,runs/ARM/seedK,sweep/CELL/seedK,regime/CAND/seedK}/record.json (reproduce.py's
records: a hash of whole config sections) become RUNS/study/runs/ARM/seedK.json (the base: runs/base/seed0.json and
its entropy profile runs/base/entropy.json), sweep/CELL/seedK.json and regime/CAND/grpo/seedK.json; the settings added
to the config since they ran (listed in ADDED) are left out of the old rule, at the values that compute what they did.
smollm2: the base's result files and entropy.json held model.path (the fingerprint now leaves it out, as the runs'
always did); the committed ones were made with the path below.
"""

import glob
import hashlib
import json
import os
import sys

from sage_jax.experiments import runs, study

ADDED = {"data.answer_extraction": "strict", "data.instruction": None, "data.system_prompt": "",
         "rollout.max_lag": 4, "rollout.oversample": 1.5, "rollout.partial": False, "rollout.slots": None,
         "train.allow_config_change": False, "train.off_policy_steps": 0}
SMOL_MODEL_PATH = "/tmp/sage_jax_test_cache/smollm2/hf"


def old_countdown_fp(config, sections) -> str:
    d = config.to_dict()
    picked = {k: d[k] for k in sections}
    for key in ADDED:
        section, leaf = key.split(".")
        picked.get(section, {}).pop(leaf, None)
    if "data" in picked:
        picked["data"]["template"] = "qwen_math_boxed"  # "auto" since: the same prompt for countdown
    picked["experiment"] = {k: d["experiment"][k] for k in ("sft_problems", "ood_problems")}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def convert(job, old_path: str, sections) -> None:
    record = runs.read_json(old_path)
    if record["fingerprint"] != old_countdown_fp(job.config, sections):
        raise SystemExit(f"{old_path}: made with other settings than {job.label}'s")
    evals = {split: {key: [p[key] for p in problems] for key in ("n", "correct", "distinct", "solutions", "strategies")}
             for split, problems in record["eval"].items()}
    config = job.config
    runs.write_result(job.path, {**{k: v for k, v in record.items() if k not in ("entropy", "eval")},
                                 "schema": runs.SCHEMA, "arm": job.arm, "seed": job.seed, "eval": evals,
                                 "fingerprint": job.fingerprint, "n": int(config.eval.n),
                                 "tau": float(config.loss.tau) if config.loss.guide == "branch" else None})
    os.remove(old_path)


def countdown(root: str) -> None:
    mod = runs.settings(os.path.join(runs.ROOT, "configs", "countdown_arms.py"))
    results, base_sections = os.path.join(root, "study"), ("model", "data", "sft", "eval", "seed")
    run_sections = base_sections + ("rollout", "loss", "optim", "train")
    base = runs.read_json(os.path.join(results, "base", "record.json"))
    branch = runs.load_config(mod, "grpo_branch", "study")
    runs.write_result(os.path.join(results, "runs", "base", "entropy.json"),
                      {"fingerprint": runs.entropy_fingerprint(mod, branch), **base["entropy"]})
    session = study.Session(mod, runs.load_config(mod, "grpo", "study"), "", results, "/tmp/unused")
    tau, sweep_taus = study.tau_for(session, list(mod.SEEDS_PER_ARM), "study", [], compute=False)
    jobs = study.make_jobs(mod, list(mod.SEEDS_PER_ARM), None, "study", [], results, "/tmp/unused", tau)
    for job in jobs:
        old = (os.path.join(results, "base", "record.json") if job.arm == "base" else
               os.path.join(results, "runs", job.arm, f"seed{job.seed}", "record.json"))
        convert(job, old, base_sections if job.arm == "base" else run_sections)
    for job in study.sweep_jobs(mod, "study", None, [], results, "/tmp/unused", tau, sweep_taus):
        old = os.path.join(results, os.path.dirname(job.label), f"seed{job.seed}", "record.json")
        if os.path.exists(old):  # the centre cell is the arm's own runs
            convert(job, old, run_sections)
    for name in mod.REGIME_CANDIDATES:
        for seed in range(3):
            old = os.path.join(results, "regime", name, f"seed{seed}", "record.json")
            if os.path.exists(old):
                job = study.job(mod, "grpo", seed, "study", [], results, "/tmp/unused", None,
                                os.path.join("regime", name), mod.candidate(name, "study"))
                convert(job, old, run_sections)
    left = glob.glob(os.path.join(results, "**", "record.json"), recursive=True)
    if left:
        raise SystemExit(f"not converted: {left}")


def smollm2(out: str) -> None:
    mod = runs.settings(os.path.join(runs.ROOT, "configs", "smollm2_arms.py"))
    path = [f"--config.model.path={SMOL_MODEL_PATH}"]
    for file in glob.glob(os.path.join(out, "**", "*.json"), recursive=True):
        record = runs.read_json(file)
        if not isinstance(record, dict) or "fingerprint" not in record:
            continue
        if file.endswith("entropy.json"):
            config = runs.load_config(mod, "branch", "study", path)
            new = runs.entropy_fingerprint(mod, runs.load_config(mod, "branch", "study"))
            old = old_entropy_fp(mod, config)
        elif record.get("arm") == "base":
            name = os.path.relpath(file, out).split(os.sep)
            settings_ = mod.candidate(name[1], "study") if name[0] == "regime" else None
            config = runs.load_config(mod, "base", "study", path, record["seed"], settings_)
            old = old_base_fp(mod, config)
            new = runs.fingerprint(mod, runs.load_config(mod, "base", "study", [], record["seed"], settings_))
        else:
            continue
        if record["fingerprint"] != old:
            raise SystemExit(f"{file}: made with other settings ({record['fingerprint']} != {old})")
        record["fingerprint"] = new
        runs.write_result(file, record)


def _old_pick(mod, config, keep) -> dict:
    items = runs.flat(config.to_dict())
    inert = {k for key, (off, keys) in runs.INERT.items() if items.get(key) == off for k in keys}
    return {k: v for k, v in items.items() if k not in inert and runs._matches(k, keep)}


def old_entropy_fp(mod, config) -> str:
    return runs._hash(_old_pick(mod, config, runs.ENTROPY_KEYS))


def old_base_fp(mod, config) -> str:
    return runs._hash({"kind": "base", **_old_pick(mod, config, runs.BASE_KEYS)})


if __name__ == "__main__":
    {"countdown": countdown, "smollm2": smollm2}[sys.argv[1]](sys.argv[2])
