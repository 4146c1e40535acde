"""docs/concepts/architecture.md stays true: the import rules between layers hold, and every repository path
the document names exists."""

import ast
import re

import pytest
from pathlib import Path

ROOT = Path(__file__).parent.parent
PKG = ROOT / "asyncrl"

# what each top-level part of the package may import (besides itself); launch and cli: anything
BASE = {"api", "errors", "config", "imports", "plugins", "listening"}
ALLOWED = {
    "api": set(),
    "errors": set(),
    "listening": set(),
    "config": {"errors"},
    "imports": {"errors"},
    "plugins": {"config", "errors", "imports"},
    "models": BASE,
    "data": BASE | {"models"},
    "reward": BASE | {"models"},
    "inference": BASE | {"models"},
    "rollout": BASE | {"models", "reward", "inference"},
    "proxy": BASE | {"models", "reward", "inference"},
    "train": BASE | {"models"},
}


def imported_parts(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("asyncrl.")}
    return out


def test_layers_import_downward_only():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).parts
        part = rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")
        if part not in ALLOWED:
            continue
        extra = imported_parts(path) - ALLOWED[part] - {part}
        if extra:
            bad.append(f"{path.relative_to(ROOT)} imports asyncrl.{sorted(extra)}")
    assert not bad, "\n".join(bad)


def test_only_the_cli_imports_the_view():
    """asyncrl/view/ reads run directories from the outside: no job depends on it."""
    bad = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
           if "view" in imported_parts(p) and p.parent.name != "view" and p.name != "cli.py"]
    assert not bad, bad


def test_every_path_architecture_md_names_exists():
    text = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:asyncrl|tests)/[\w/.]+)`", text))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"docs/concepts/architecture.md names paths that do not exist: {missing}"


def test_docs_point_at_documents_in_the_repository():
    for path in [*ROOT.glob("*.md"), *(ROOT / "tests").glob("*.py"), *PKG.rglob("*.py")]:
        for doc in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", path.read_text()):
            assert (ROOT / doc).is_file(), f"{path.relative_to(ROOT)} cites {doc}, not in the repo"


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports (inside functions too; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If)
            and "TYPE_CHECKING" in ast.unparse(n.test) for b in n.body for x in ast.walk(b)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_no_import_cycle_between_files():
    """One file of asyncrl/ never imports, through others, a file that imports it (package
    __init__ files aside: they only re-export)."""
    import graphlib

    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in PKG.rglob("*.py")
             if p.name != "__init__.py"}
    graph = {m: _imported_modules(p, set(files)) - {m} for m, p in files.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None


def test_engines_take_the_parameters_their_protocols_name():
    """Protocols say what callers use: each method of ServingEngine and TrainEngine exists on the
    engines a job builds and takes exactly the protocol's parameters."""
    import inspect

    from asyncrl.api.protocols import ServingEngine, TrainEngine
    from asyncrl.inference.async_engine import AsyncLLMEngine
    from asyncrl.inference.remote import RemoteInferenceEngine
    from asyncrl.train.engine import HFTrainEngine

    for proto, impls in ((ServingEngine, (AsyncLLMEngine, RemoteInferenceEngine)),
                         (TrainEngine, (HFTrainEngine,))):
        methods = {n for base in proto.__mro__ if base.__module__ == proto.__module__
                   for n, v in vars(base).items() if inspect.isfunction(v) and n[0] != "_"}
        assert methods, proto
        for impl in impls:
            for name in methods:
                want = list(inspect.signature(getattr(proto, name)).parameters)
                got = list(inspect.signature(getattr(impl, name)).parameters)
                assert got == want, (
                    f"{impl.__name__}.{name}{tuple(got)} does not take "
                    f"{proto.__name__}.{name}{tuple(want)}")


def test_no_caller_probes_an_engine_or_reaches_through_one():
    """No `hasattr(engine, ...)` probe and no `x.engine.engine` reach-through in the package:
    what callers need is in the engines' protocols."""
    probe = re.compile(r"hasattr\(\s*[\w.]*engine|\bengine\.engine\.")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted(PKG.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert not found, "\n".join(found)


def _module_imports(path: Path) -> set[str]:
    """The asyncrl modules a file imports, anywhere in it (inside functions too), except under
    `if TYPE_CHECKING:` and except packages' __init__ files (what `from asyncrl.x import y`
    passes through)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in PKG.rglob("*.py")
               if p.name != "__init__.py"}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asyncrl"):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("asyncrl")]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def test_no_import_cycle_between_files():
    """No two files import each other, directly or through others (lazy imports inside
    functions count: a cycle is a design knot whether or not Python resolves it)."""
    import graphlib

    graph = {".".join(p.relative_to(ROOT).with_suffix("").parts): _module_imports(p)
             for p in PKG.rglob("*.py") if p.name != "__init__.py"}
    for module, deps in graph.items():
        deps.discard(module)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle: {' -> '.join(err.args[1])}")
