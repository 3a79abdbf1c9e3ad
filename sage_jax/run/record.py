"""A resume with other settings: compare the config with the one the newest checkpoint was made with.

Every checkpoint's meta holds the config it was trained with ("config"). On resume, a field outside MAY_CHANGE that
differs stops the run with one line naming the fields (a field the checkpoint's config lacks, added to the code
since, counts as its default in configs/base.py), unless --config.train.allow_config_change=True: then the
change is appended to WORKDIR/config_changes.json ({"step", "time", "changed": {field: {"checkpoint", "now"}},
"config"}: the step it happened at and the whole new config) and WORKDIR/config.json, the run's first config, is
left as it is (trainer.run_rl writes it only on a fresh start). A change of the trained state's shapes (the LoRA
rank or targets) is refused either way: such a checkpoint cannot be restored into this run.
"""

from __future__ import annotations

import datetime
import fnmatch
import functools
import json
import logging as pylogging
import os
from typing import Any, Callable

from sage_jax.run import config as config_lib, paths

log = pylogging.getLogger("sage_jax")

# What a resume may change: how long to train, how often to save / evaluate / log, what the evaluations measure,
# where the data lives, and how the same computation is laid out on the devices or cut into passes (memory and
# speed, not the numbers): mesh, attention kernel, remat, logits chunk, log-prob rows, micro-batches, packing,
# reward workers and their limits, decode slots (rollout.slots: the sampler's outputs do not depend on them), the
# decode attention's form (the same attention, rounded as each form rounds), and
# the evaluation sets (data.eval, data.eval_problems, the generated ones' sizes and ranges: no training set depends
# on them). Note that train.steps also sets the length of a cosine learning-rate schedule and of the loss schedules
# (objectives.LossConfig total_steps), so more steps reshape those schedules' tails.
MAY_CHANGE = ("train.steps", "train.ckpt_every", "train.keep_ckpts", "train.eval_every", "train.sample_every",
              "train.progress", "train.use_tensorboard", "train.use_wandb", "train.export_hf", "train.reward_workers",
              "train.reward_timeout", "train.reward_memory_mb", "train.logprob_rows", "train.packing",
              "train.allow_config_change", "eval.*", "mesh.*", "model.attention", "model.remat",
              "model.logits_chunk", "optim.grad_accum", "data.data_dir", "sft.ckpt_every", "rollout.slots",
              "rollout.decode_attention",
              "data.eval", "data.eval_problems", "data.num_eval", "data.ood_num_numbers", "data.ood_max_number")
# where the model is read from may change when the checkpoint recorded a fingerprint of the weights it loaded
# (meta "model" "weights_fingerprint", compared by Checkpointer.check_model before this check: an RL run's reference
# or LoRA base); SFT's checkpoints record none
WEIGHTS_CHECKED = ("model.path",)
# the trained state's shapes: a checkpoint made with others cannot be restored, even with allow_config_change
STATE_SHAPES = ("model.lora.rank", "model.lora.targets")
# an SFT checkpoint depends only on these (SFT sets its own lr, warm-up, schedule and weight decay); its length may
# change too
SFT_FIELDS = ("seed", "model.*", "tokenizer_path", "data.*", "sft.*", "optim.b1", "optim.b2", "optim.eps",
              "optim.grad_clip")
SFT_MAY_CHANGE = ("sft.steps",)

CHANGES_FILE = "config_changes.json"


def as_record(config) -> dict[str, Any]:
    """The config as the JSON a checkpoint's meta stores (tuples become lists), for an exact comparison."""
    from sage_jax.run.checkpoint import _jsonable
    return _jsonable(config.to_dict())


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _matches(key: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    """The current code's default config (configs/base.py beside the package), flat; {} where there is none."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                        "base.py")
    try:
        return _flat(as_record(config_lib.load_file(path)))
    except config_lib.ConfigError:
        return {}


def differences(saved: dict[str, Any], now: dict[str, Any], sft: bool = False,
                allowed: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """{field: {"checkpoint": old, "now": new}} for every field outside MAY_CHANGE (and `allowed`) that differs; a
    field the checkpoint's config lacks is compared as its default (added to the code since)."""
    old, new = _flat(saved), _flat(now)
    allowed = MAY_CHANGE + (SFT_MAY_CHANGE if sft else ()) + tuple(allowed)
    out = {}
    for key in sorted(set(old) | set(new)):
        if _matches(key, allowed) or (sft and not _matches(key, SFT_FIELDS)):
            continue
        before = old[key] if key in old else _defaults().get(key, "<absent>")
        if before != new.get(key, "<absent>"):
            out[key] = {"checkpoint": before, "now": new.get(key, "<absent>")}
    return out


def _weights_recorded(ckpt, step: int) -> bool:
    meta = ckpt.read_meta(step)
    return isinstance(meta, dict) and isinstance(meta.get("model"), dict) and "weights_fingerprint" in meta["model"]


def _saved_config(ckpt, step: int, workdir: str) -> dict[str, Any] | None:
    meta = ckpt.read_meta(step)
    if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
        return meta["config"]
    path = os.path.join(workdir, "config.json")  # checkpoints written before meta held the config
    try:
        saved = json.loads(paths.read_agreed(path) or b"null")  # process 0's file: every process decides alike
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def check_resume(config, ckpt, workdir: str, sft: bool = False, check_model: Callable[[], None] = lambda: None,
                 ) -> None:
    """ConfigError if the newest checkpoint in `ckpt` was made with other settings (see module doc); call on every
    process before restoring. check_model (the checkpoint's model against this run's, e.g. Checkpointer.check_model)
    runs after the settings are compared, so a changed setting is named even where it also changes the weights
    (with random-init weights the fingerprint follows `seed`), and before a change is recorded."""
    step = ckpt.latest_step()
    saved = None if step is None else _saved_config(ckpt, step, workdir)
    if saved is None:
        check_model()
        return
    allowed = WEIGHTS_CHECKED if not sft and _weights_recorded(ckpt, step) else ()
    changed = differences(saved, as_record(config), sft=sft, allowed=allowed)
    if not changed:
        check_model()
        return
    listing = "; ".join(f"{k}: checkpoint {v['checkpoint']!r}, now {v['now']!r}" for k, v in changed.items())
    ranks = _flat(saved).get("model.lora.rank", 0), config.model.lora.rank
    shapes = {k: v for k, v in changed.items() if k in STATE_SHAPES and any(ranks)}  # rank 0 has no adapters
    if shapes:
        what = "LoRA rank" if "model.lora.rank" in shapes else "LoRA targets"
        raise config_lib.ConfigError(
            f"the {what} differs from the checkpoint's at step {step} in {ckpt.directory} ("
            + "; ".join(f"{k}: checkpoint {v['checkpoint']!r}, now {v['now']!r}" for k, v in shapes.items())
            + "): its adapters do not fit this run's, so it cannot be restored, not even with allow_config_change; "
            "the checkpoint is fine: rerun with the original "
            + ", ".join(f"--config.{k}={_flag(v['checkpoint'])}" for k, v in shapes.items())
            + ", or pass another --workdir to start with the new one")
    if not config.train.get("allow_config_change", False):
        raise config_lib.ConfigError(
            f"the checkpoint at step {step} in {ckpt.directory} was made with other settings ({listing}): rerun with "
            "the original values, pass another --workdir, or add --config.train.allow_config_change=True to go on "
            f"with the new ones (recorded in {os.path.join(workdir, CHANGES_FILE)})")
    check_model()
    log.warning("resuming at step %d with changed settings (%s); recorded in %s", step, listing,
                os.path.join(workdir, CHANGES_FILE))
    import jax
    if jax.process_index() == 0:
        _append(os.path.join(workdir, CHANGES_FILE), {
            "step": step, "time": datetime.datetime.now().isoformat(timespec="seconds"), "changed": changed,
            "config": as_record(config)})


def _flag(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _append(path: str, entry: dict[str, Any]) -> None:
    entries: list[Any] = []
    if paths.exists(path):
        try:
            entries = json.loads(paths.read_text(path))
        except (OSError, ValueError):
            entries = None
        if not isinstance(entries, list):  # keep an unreadable record beside the new one rather than drop it
            paths.rename(path, path + ".unreadable")
            log.warning("%s was not a JSON list; moved it to %s.unreadable", path, path)
            entries = []
    entries.append(entry)
    paths.write_text(path, json.dumps(entries, indent=2, sort_keys=True, default=str) + "\n")
