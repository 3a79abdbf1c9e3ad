"""The package's layout: no import circles of modules or of folders, folders import one way only (each only the
folders on the floors below it), the top level holds only the faces (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sage_jax"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the sage_jax modules it imports}, from the source text; package __init__ files are left out."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            continue
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from sage_jax import model` names a module; `from sage_jax.models.decoder import forward` names its module
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                               for a in node.names)
        graph[name] = {t for t in targets
                       if t in modules and t != name and modules[t].name != "__init__.py"}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_finder_sees_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "sage_jax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from sage_jax import b\n")
    (pkg / "b.py").write_text("def f():\n    from sage_jax.a import g\n")
    (pkg / "c.py").write_text("import sage_jax.a\n")
    assert find_cycles(import_graph(pkg)) == [["sage_jax.a", "sage_jax.b"]]


def test_no_import_circles_in_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles in sage_jax/: " + "; ".join(" <-> ".join(c) for c in cycles)


# The floors of sage_jax/, lowest first (the package docstring draws them). A folder may import the folders of lower
# floors only; the faces (top-level modules) may import anything, and nothing imports a face.
FLOORS = [("rewards",), ("models", "tools"), ("data", "sampling", "rl", "run"), ("eval",), ("training",),
          ("bench",), ("experiments", "plan")]
FACES = {"train", "sft", "evaluate", "patterns", "convert_gguf"}
MAX_TOP_LEVEL_MODULES = 9


def _floor(folder: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if folder in names)


def folder_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """{(folder, folder it imports): ["module -> module", ...]}; a top-level module is its own folder."""
    edges: dict[tuple[str, str], list[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            fa, fb = a.split(".")[1], b.split(".")[1]
            if fa != fb:
                edges.setdefault((fa, fb), []).append(f"{a} -> {b}")
    return edges


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for (fa, fb), why in sorted(folder_edges(graph).items()):
        if fb in FACES:
            bad.append(f"{fa} imports the face {fb}: {why}")
        elif fa not in FACES and _floor(fb) >= _floor(fa):
            bad.append(f"{fa} (floor {_floor(fa)}) imports {fb} (floor {_floor(fb)}): {why}")
    return bad


def test_every_folder_is_on_a_floor_and_documented():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert sorted(f for floor in FLOORS for f in floor) == folders
    for name in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and "Imports:" in doc, f"sage_jax/{name}/__init__.py: a docstring that says what it may import"


def test_the_top_level_holds_the_faces_only():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert set(modules) == FACES and len(modules) + 1 <= MAX_TOP_LEVEL_MODULES


def test_folders_import_one_way_only():
    bad = layering_violations(import_graph())
    assert not bad, "imports that run up or sideways:\n" + "\n".join(bad)


def test_the_layering_check_sees_an_import_that_runs_up(tmp_path):
    pkg = tmp_path / "sage_jax"
    for folder in ("models", "training"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "training" / "loop.py").write_text("from sage_jax.models import decoder\n")
    (pkg / "models" / "decoder.py").write_text("def f():\n    from sage_jax.training import loop\n")
    (pkg / "train.py").write_text("from sage_jax.training import loop\n")
    assert layering_violations(import_graph(pkg)) == [
        "models (floor 1) imports training (floor 4): ['sage_jax.models.decoder -> sage_jax.training.loop']"]


def test_the_public_names_resolve_lazily():
    import subprocess
    import sys
    code = ("import sys, sage_jax; assert 'jax' not in sys.modules, 'sage_jax imported jax'; "
            "from sage_jax import model, sampler, objectives, evaluation, trainer; "
            "import sage_jax.rewards.math as m; "
            "fns = [model.load_hf, model.forward, sampler.generate, objectives.loss_fn, objectives.kl_term, "
            "objectives.group_advantages, evaluation.pass_at_k, trainer.rl_step, m.verify]; print(len(fns))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"}, cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stdout.strip() == "9", out.stderr[-2000:]
