"""Where `python -m sage_jax.evaluate --model` points: an HF directory or a training workdir (its hf_export/, or an RL
checkpoint rebuilt from the run's config.json), and loading its tokenizer and params onto a mesh.

A training workdir may be a gs:// one (read through run/paths.py); there its RL checkpoint is evaluated, since an HF
folder is read from a local disk only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sage_jax.run import paths


@dataclasses.dataclass
class ModelSource:
    kind: str  # "hf" (a safetensors directory) or "checkpoint" (an RL checkpoint of a training workdir)
    path: Path  # the HF directory, or the workdir
    step: int | None = None  # checkpoint step
    run_config: Any = None  # the training run's ConfigDict when known (workdir/config.json)
    workdir: Path | None = None


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()


def read_run_config(workdir: Path) -> Any:
    """The training run's config (written by MetricsLogger as WORKDIR/config.json), or None."""
    import ml_collections
    path = workdir / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it or point --model elsewhere") from None
    return ml_collections.ConfigDict(data) if isinstance(data, dict) and "model" in data and "data" in data else None


def resolve_model(model: str, step: int | None = None) -> ModelSource:
    path = paths.path(model) if paths.is_remote(model) else Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist; pass an HF model directory or a training "
                                "workdir to --model")
    run_config = read_run_config(path)
    if run_config is not None:  # a training workdir
        export = path / "hf_export"
        if step is None and not paths.is_remote(path) and (export / "config.json").is_file() and _has_weights(export):
            return ModelSource("hf", export, run_config=run_config, workdir=path)
        steps = checkpoint_steps(path / "rl")
        if not steps:
            raise FileNotFoundError(f"workdir {path} has neither hf_export/ nor checkpoints under {path / 'rl'}; "
                                    "train first or pass an HF model directory")
        if step is not None and step not in steps:
            raise FileNotFoundError(f"--step {step}: no such checkpoint in {path / 'rl'}; available steps: {steps}")
        return ModelSource("checkpoint", path, step if step is not None else steps[-1], run_config, path)
    if step is not None:
        raise ValueError(f"--step needs a training workdir; {path} has no run config.json")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: pass an HF model directory (config.json + *.safetensors"
                                " + tokenizer files) or a training workdir")
    if not _has_weights(path):
        raise FileNotFoundError(f"no *.safetensors weights in {path}; convert the checkpoint to safetensors or pass "
                                "another model directory")
    parent = path.parent  # WORKDIR/hf_export given directly: the run config sits one level up
    parent_config = read_run_config(parent) if path.name == "hf_export" else None
    return ModelSource("hf", path, run_config=parent_config, workdir=parent if parent_config is not None else None)


def checkpoint_steps(rl_dir: Path) -> list[int]:
    """Finished checkpoint steps (orbax renames a step folder into place only once it is complete)."""
    ckpt_dir = rl_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and (p / "state").is_dir())


def default_out(source: ModelSource) -> Path:
    if source.workdir is not None:
        return source.workdir / "eval" / ("hf_export" if source.kind == "hf" else f"step{source.step}")
    return Path("eval") / source.path.resolve().name


def load_tokenizer(source: ModelSource, task: str, tokenizer_dir: str = "") -> Any:
    if task == "countdown":
        from sage_jax.data.tasks import _CountdownTok
        return _CountdownTok()
    from sage_jax.data.tokenizer import Tokenizer
    if tokenizer_dir:
        return Tokenizer.from_pretrained(tokenizer_dir)
    candidates = []
    if source.kind == "hf":
        candidates.append(str(source.path))
    if source.run_config is not None:
        candidates += [source.run_config.tokenizer_path, source.run_config.model.path]
    tok_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    from sage_jax.data import char_tokenizer
    for c in candidates:
        if c == char_tokenizer.NAME or c and any((Path(c).expanduser() / f).exists() for f in tok_files):
            return Tokenizer.from_pretrained(c)
    raise FileNotFoundError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) in "
                            f"{candidates or [source.path]}; pass --tokenizer DIR")


def load_model(source: ModelSource, tokenizer: Any, dtype: str, mesh: Any, rules: Any) -> tuple[Any, Any]:
    """(cfg, params) on the mesh, in `dtype`, with the tokenizer's stop and pad ids."""
    import jax
    import jax.numpy as jnp
    from sage_jax.models import hf_io
    from sage_jax.run import checkpoint
    from sage_jax.models import build
    from sage_jax.models import decoder as model_lib
    if source.kind == "hf":
        cfg, params = model_lib.load_hf(source.path, dtype=jnp.dtype(dtype), mesh=mesh, rules=rules)
        if source.run_config is not None:  # an export of a run: the same cfg as its checkpoints (one compile)
            cfg = build.model_config(source.run_config, base=cfg)
    else:
        config = source.run_config
        base = None
        if config.model.path:
            hf_config = Path(config.model.path).expanduser() / "config.json"
            if not hf_config.is_file():
                raise FileNotFoundError(f"the run started from {config.model.path}, whose config.json is needed to "
                                        "rebuild the model shape; make it available at that path")
            base = hf_io.config_from_hf(json.loads(hf_config.read_text()))
        cfg = build.model_config(config, vocab_size=getattr(tokenizer, "vocab_size", None), base=base)
        cfg = cfg.replace(param_dtype=dtype)
        shardings = model_lib.param_shardings(cfg, mesh, rules)
        shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
        abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
        params = checkpoint.restore_params(source.path / "rl", source.step, abstract, dtype)
    cfg = cfg.replace(param_dtype=dtype, compute_dtype=dtype, eos_token_ids=tuple(tokenizer.eos_ids),
                      pad_token_id=int(tokenizer.pad_id))
    return cfg, params
