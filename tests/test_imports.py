"""The package's import structure: layers import downwards only, no module imports
another that (directly or not) imports it back, and imports sit at module level except
for optional, backend-specific or slow ones (`LAZY_OK`), which starting a run leaves
unloaded."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jrl", "pallas_kernels")

# What each layer may never import (prefix match on module names). Entry-point modules
# (`__main__`, and `jrl.launch` / `jrl.cli` above everything) are programs, not layers.
FORBIDDEN = {
    "jrl.config": ("jrl.",),
    "jrl.models": ("jrl.rollout", "jrl.train", "jrl.rl", "jrl.data", "jrl.launch"),
    "jrl.rollout": ("jrl.train", "jrl.rl", "jrl.data", "jrl.launch"),
    "jrl.data": ("jrl.rollout", "jrl.train", "jrl.rl", "jrl.launch"),
    "jrl.train": ("jrl.rl", "jrl.launch"),
    "jrl.rl": ("jrl.launch",),
    "pallas_kernels": ("jrl.",),
}
# In-function imports allowed, with why: a GPU-only backend that CPU machines may lack;
# modules slow to import that most processes never use (matplotlib, 1 s: only plotting;
# the Mosaic GPU kernels, 0.5 s: only where a kernel runs), which every `python -m
# jrl.train` and every test subprocess would otherwise pay at start.
LAZY_OK = {
    ("jrl.models.attention", "jax._src.cudnn.fused_attention_stablehlo"),
    ("jrl.plot", "matplotlib.figure"),
    ("jrl.plot", "matplotlib.backend_bases"),
    *(("pallas_kernels.dispatch", f"pallas_kernels.{kernel}")
      for kernel in ("decode_mgpu", "exact_mgpu", "gemm_mgpu", "prefill_mgpu", "stream_gemm_mgpu")),
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_entry_point(name: str) -> bool:
    return name.endswith(".__main__") or name in ("jrl.launch", "jrl.cli")


def _imports(name: str, tree: ast.Module) -> list[tuple[str, bool]]:
    """(imported module, imported at module level) for every import in `tree`; a
    `from a import b` names `a.b` when that is a module of ours."""
    top = {id(n) for n in tree.body}
    for node in tree.body:  # module-level `if`/`try` blocks count as module level too
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.append((sub if sub in MODULES else node.module, id(node) in top))
    return found


GRAPH = {name: _imports(name, ast.parse(path.read_text())) for name, path in MODULES.items()}


def test_imports_sit_at_module_level_unless_optional():
    lazy = sorted((name, mod) for name, imports in GRAPH.items() for mod, at_top in imports
                  if not at_top and (name, mod) not in LAZY_OK)
    assert lazy == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_downwards_only(layer):
    bad = sorted((name, mod) for name, imports in GRAPH.items()
                 if (name == layer or name.startswith(layer + ".")) and not _is_entry_point(name)
                 for mod, _ in imports if any(mod.startswith(p) for p in FORBIDDEN[layer]))
    assert bad == []


def test_no_import_cycles_between_modules():
    edges = {name: {m for m, at_top in imports if at_top and m in MODULES and m != name}
             for name, imports in GRAPH.items()}
    # A package's __init__ re-exporting its own submodules is not a cycle of the code.
    for name in edges:
        edges[name] = {m for m in edges[name] if not (name.startswith(m + ".") and MODULES[m].name == "__init__.py")}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_trainer_never_reaches_into_rl():
    """The GRPO loop is handed to the trainer (jrl.rl.build_learner), never looked up by it."""
    assert not any(m.startswith("jrl.rl") for name, imports in GRAPH.items() if name.startswith("jrl.train")
                   and not _is_entry_point(name) for m, _ in imports)


def test_starting_a_run_loads_neither_matplotlib_nor_the_kernels():
    """`python -m jrl.train`'s imports leave the slow optional modules (LAZY_OK) unloaded."""
    code = ("import sys, jrl.launch; print(sorted(m for m in sys.modules if m.startswith('matplotlib') "
            "or m.startswith('pallas_kernels.') and m.endswith('_mgpu')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
