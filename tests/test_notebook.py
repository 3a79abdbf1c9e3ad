"""notebooks/sage_colab.ipynb runs top to bottom, headless, in its LOCAL_TINY mode (tiny random model, CPU)."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "sage_colab.ipynb"
CELL_TIMEOUT_S = 180


def _read():
    return nbformat.read(NOTEBOOK, as_version=4)


def _parameters_index(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "the notebook needs exactly one cell tagged 'parameters' (papermill)"
    return tagged[0]


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out and "text/plain" in out.data:
            parts.append(out.data["text/plain"])
    return "".join(parts)


def _has_png(cell) -> bool:
    return any("data" in out and "image/png" in out.data for out in cell.get("outputs", []))


def test_notebook_shape():
    nb = _read()
    nbformat.validate(nb)
    params = nb.cells[_parameters_index(nb)]
    assert params.cell_type == "code"
    defaults = {}
    for node in ast.parse(params.source).body:  # the parameters cell holds plain literal assignments only
        assert isinstance(node, ast.Assign), ast.dump(node)
        defaults[node.targets[0].id] = ast.literal_eval(node.value)
    assert defaults["LOCAL_TINY"] is False and defaults["WORKDIR"] == ""
    assert {"SAGE_JAX_SOURCE", "MODEL_NAME", "TRAIN_DATA", "EVAL_DATA", "N", "KS", "RL_STEPS"} <= set(defaults)
    for cell in nb.cells:
        if cell.cell_type == "code":
            ast.parse(cell.source)  # no syntax errors, no IPython magics (cells stay plain Python)
            assert not cell.get("outputs"), "commit the notebook without outputs"


def _install_cell(nb):
    return next(c for c in nb.cells if c.cell_type == "code" and "def locate_code" in c.source)


def test_install_cell_outside_a_checkout(tmp_path, monkeypatch):
    """As on Colab: no checkout above the working directory; the code comes from SAGE_JAX_SOURCE."""
    import os
    import subprocess
    import sys
    import zipfile
    source = _install_cell(_read()).source
    calls = []
    monkeypatch.setattr(subprocess, "check_call", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.chdir(tmp_path)
    fake = tmp_path / "src" / "sage_jax-main"
    (fake / "sage_jax").mkdir(parents=True)
    (fake / "configs").mkdir()
    (fake / "configs" / "base.py").write_text("")
    (fake / "requirements.txt").write_text("jax>=0.7  # pinned\nml_collections>=1.0\n")
    with zipfile.ZipFile(tmp_path / "sage_jax.zip", "w") as z:
        for f in fake.rglob("*"):
            z.write(f, f.relative_to(fake.parent))

    def run(source_value):
        ns = {"os": os, "sys": sys, "Path": Path, "WORKDIR": tmp_path / "work", "SAGE_JAX_SOURCE": source_value}
        (tmp_path / "work").mkdir(exist_ok=True)
        exec(compile(source, "install-cell", "exec"), ns)
        return ns["REPO_DIR"]

    repo = run(str(tmp_path / "sage_jax.zip"))
    assert repo == tmp_path / "work" / "sage_jax_src" / "sage_jax-main" and str(repo) in os.environ["PYTHONPATH"]
    assert calls[-1][1:4] == ["-m", "pip", "install"] and "ml_collections>=1.0" in calls[-1]
    assert run(str(fake)) == fake.resolve()
    if not Path("/content").is_dir():
        with pytest.raises(ValueError, match="set SAGE_JAX_SOURCE in the Parameters cell"):
            run("")
    calls.clear()
    (tmp_path / "work" / "sage_jax_src").rename(tmp_path / "old")
    import shutil
    monkeypatch.setattr(subprocess, "check_call", lambda cmd, **kw: calls.append(cmd) or (
        cmd[0] == "git" and shutil.copytree(fake, cmd[-1])))
    assert run("https://example.invalid/sage_jax.git") == tmp_path / "work" / "sage_jax_src"
    assert calls[0][:2] == ["git", "clone"] and "https://example.invalid/sage_jax.git" in calls[0]


def _top_level(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_notebook_runs_tiny(tmp_path, monkeypatch):
    nb = _read()
    workdir = tmp_path / "work"
    injected = nbformat.v4.new_code_cell(f"LOCAL_TINY = True\nWORKDIR = {str(workdir)!r}\n",
                                         metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(_parameters_index(nb) + 1, injected)
    # the kernel is a fresh process: one CPU device (not conftest's 8 simulated ones), no GPU/TPU probing, and
    # unoptimised XLA code (compiling dominates this run; optimising halves the compile time, not the work)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    before_repo, before_notebooks = _top_level(REPO), _top_level(NOTEBOOK.parent)

    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the failing cell
    elapsed = time.perf_counter() - start
    print(f"notebook executed in {elapsed:.1f} s")

    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(_text(c) for c in code)
    assert "LOCAL_TINY: True" in text
    assert re.search(r"a hand-written correct answer:\s+True", text) and re.search(r"a wrong one:\s+False", text)
    for phase in ("before RL:", "after RL: "):
        line = next(l for l in text.splitlines() if l.startswith(phase))
        values = [float(v) for v in re.findall(r"pass@\d+ = ([0-9.]+)", line)]
        assert len(values) == 3 and all(0.0 <= v <= 1.0 for v in values), line
    curves, pass_plot = code[-2], code[-1]
    assert _has_png(curves) and "rl/entropy" in _text(curves) and "rl/kl" in _text(curves)
    assert _has_png(pass_plot) and "| before |" in _text(pass_plot) and "| after |" in _text(pass_plot)

    # everything went to the workdir, nothing next to the notebook or at the repository root
    for name in ("metrics.jsonl", "summary.json", "pass_at_k.png", "eval/before", "eval/after"):
        assert (workdir / "run" / name).exists(), name
    written = {"run", "data", "tiny_qwen2", "training_curves.png", "pass_at_k.png", "sage_jax_src"}
    assert (workdir / "training_curves.png").is_file() and (workdir / "pass_at_k.png").is_file()
    assert not (_top_level(REPO) - before_repo) & written
    assert _top_level(NOTEBOOK.parent) == before_notebooks
    assert elapsed < 300, f"tiny notebook took {elapsed:.0f} s; keep LOCAL_TINY small"
