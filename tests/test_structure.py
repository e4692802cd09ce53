"""The house stays as docs/architecture.md draws it: imports go downwards only (the
layer table), no import circles, no crowded folders, no long modules or functions.

The import checks read the product's source as text (the packages pyproject.toml installs,
`overnight.testing` included); nothing is imported. Every import counts, wherever it
stands: one inside a function or under `if TYPE_CHECKING:` still ties two modules
together, and hiding a circle or an upward import there is exactly what they are for.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Two limits, each for what a reader holds at once. A module: one subject, read top to
# bottom in a sitting; 600 lines leaves room for a whole subject (nanoGPT's train.py is
# 336, vLLM's serving classes run to 500-900), where a cap of 450 made three commits split
# files by count. A function: seen whole on a screen, a hub reading as the names of its
# stages; past 80 lines it is nearly always several steps sharing a body. Split by
# subject and by step, never by count.
MAX_LINES = 600
MAX_FUNCTION_LINES = 80
# Functions over the limit today, each waiting for its split (issue 37: a night read as
# its steps, a request as its stages). A test checks each is still over: mend one, and
# take it off this list.
LONG_FUNCTIONS_TO_SPLIT: dict[str, str] = {}
# A folder a reader takes in at a glance: past 16 modules (its __init__.py counted), it
# holds more than one subject; a sub-package names the one that grew.
MAX_FOLDER_MODULES = 16


# Which way imports go (docs/architecture.md, "Which way imports go"): each layer, by the
# name of its package (or of a module with a layer of its own), and the layers it may
# import besides its own. A module is in the layer its name is listed under, else in its
# package's; every package must be listed (a new one is placed here, or this fails), and
# so must every module of the ground.
def _downwards(levels: list[set[str]], outside: set[str]) -> dict[str, set[str]]:
    """Levels drawn top first: each may import every level below it and `outside`,
    never one beside or above it (an arrow may skip levels)."""
    return {
        layer: outside.union(*levels[i + 1 :]) for i, level in enumerate(levels) for layer in level
    }


GROUND = {
    "overnight",
    "overnight.errors",
    "overnight.telemetry",
    "overnight.config",
    "overnight.progress",
}
STORAGE = {
    "overnight.storage",
    "overnight.storage.write",
    "overnight.storage.read",
    "overnight.storage.upkeep",
    "overnight.storage.bucket",
}
VIEW = {"overnight.view", "overnight.view.web"}
BELOW_THE_PARTS = GROUND | STORAGE | {"overnight.models"} | VIEW
PROXY = [
    {"overnight.proxy"},  # its __init__ (create_app)
    {"overnight.proxy.app", "overnight.proxy.address"},
    {"overnight.proxy.routes"},
    {"overnight.proxy.observe"},
    {"overnight.proxy.state", "overnight.proxy.shadow"},
    {"overnight.proxy.capture"},
    {"overnight.proxy.alias"},
    {"overnight.proxy.replicas", "overnight.proxy.vllm_sleep"},
    {"overnight.proxy.forward"},
]
TRAINER = [
    {"overnight.trainer"},  # train.py (and the __init__)
    {"overnight.trainer.run"},
    {"overnight.trainer.live"},
    {"overnight.trainer.gate"},
    {"overnight.trainer.choose"},
    {"overnight.trainer.grpo", "overnight.trainer.serving"},
]
PARTS = {"overnight.judge", "overnight.proxy.launch", "overnight.examples"}
PARTS |= set().union(*PROXY, *TRAINER)
ENTRY_POINTS = {"overnight.cli", "overnight.testing", "overnight.night", "overnight.imports"}
LAYERS: dict[str, set[str]] = {
    **dict.fromkeys(GROUND, GROUND),
    **dict.fromkeys(STORAGE, STORAGE | {"overnight.errors"}),
    "overnight.models": GROUND,
    **dict.fromkeys(VIEW, GROUND | STORAGE | VIEW),
    **_downwards(PROXY, BELOW_THE_PARTS),
    "overnight.proxy.launch": BELOW_THE_PARTS,
    "overnight.judge": BELOW_THE_PARTS,
    **_downwards(TRAINER, BELOW_THE_PARTS),
    "overnight.trainer.grpo": GROUND | {"overnight.models"},
    "overnight.examples": set(),
    "overnight.cli": BELOW_THE_PARTS
    | PARTS
    | {"overnight.testing", "overnight.night", "overnight.imports"},
    "overnight.testing": BELOW_THE_PARTS | PARTS,
    "overnight.night": BELOW_THE_PARTS | PARTS,
    "overnight.imports": BELOW_THE_PARTS | PARTS,
}
# Each layer's rule in the doc's words, for the failure to name.
RULES = {
    **dict.fromkeys(GROUND, "the ground (config, errors, telemetry) imports no part"),
    **dict.fromkeys(STORAGE, "storage imports nothing of overnight but overnight.errors"),
    "overnight.models": "overnight.models is a leaf: it stands on the ground alone",
    **dict.fromkeys(VIEW, "view imports only storage and the ground"),
    **dict.fromkeys(
        set().union(*PROXY),
        "inside the proxy, imports go down: app -> routes -> observe -> state, shadow -> "
        "capture -> alias -> replicas, vllm_sleep -> forward; proxy, judge and trainer "
        "never import one another",
    ),
    "overnight.proxy.launch": "proxy/launch imports nothing of the proxy's",
    "overnight.judge": "proxy, judge and trainer never import one another",
    **dict.fromkeys(
        set().union(*TRAINER),
        "inside the trainer, imports go down: train.py -> run -> live -> gate -> choose -> "
        "grpo, serving; proxy, judge and trainer never import one another",
    ),
    "overnight.trainer.grpo": "grpo imports no other part of the trainer and never storage: "
    "what it trains on arrives as Arrow rows or samples",
    "overnight.trainer.serving": "trainer/serving imports nothing of the trainer's",
    "overnight.examples": "the examples are agents on the plain openai SDK: nothing of ours",
    **dict.fromkeys(
        ENTRY_POINTS,
        "nothing below the entry points imports them; of them, only the CLI uses the others",
    ),
}
# Imports that break a layer today, each waiting for its fix; a test checks each still
# breaks it: mend one, and take it off this list.
KNOWN_LAYER_BREAKS: dict[tuple[str, str], str] = {}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Each installed package and its folder, as pyproject.toml maps them."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setup.get("package-dir", {})
    dirs = {}
    for package in setup["packages"]:
        # A package under a mapped one lives in the mapped folder's sub-folder.
        prefix = max((p for p in mapped if package == p or package.startswith(p + ".")), key=len)
        tail = package[len(prefix) :].lstrip(".")
        dirs[package] = root / mapped[prefix] / Path(*tail.split(".") if tail else ())
    return dirs


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every product module's dotted name and file (a package: its __init__.py)."""
    found = {}
    for package, folder in package_dirs(root).items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]):
    """The product modules one import statement names."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            package = name if path.stem == "__init__" else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        # `from package import module` names the module; `from module import name` the module.
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            yield target


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    found = modules(root)
    known = set(found)
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[name].update(_imported(name, path, node, known))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative so that a deep chain cannot exhaust the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.stem == "__init__" else name.rpartition(".")[0]


def layer_of(name: str, path: Path, layers: dict[str, set[str]]) -> str | None:
    """The layer a module is in: its own name where the table lists it, else its
    package's; None where the table places neither (or a module of the ground's package,
    which must be named: there is nothing above the ground for it to fall into)."""
    package = _package_of(name, path)
    if name in layers:
        return name
    top = min(layers, key=len)  # the top package ("overnight"): its modules each named
    return package if package in layers and package != top else None


def unplaced(root: Path = ROOT, layers: dict[str, set[str]] | None = None) -> list[str]:
    """The packages, and the modules, that the layer table does not place."""
    layers = LAYERS if layers is None else layers
    found = modules(root)
    missing = [p for p in package_dirs(root) if p not in layers]
    missing += [n for n, path in found.items() if layer_of(n, path, layers) is None]
    return sorted(set(missing))


def layer_breaks(
    root: Path = ROOT,
    layers: dict[str, set[str]] | None = None,
    rules: dict[str, str] | None = None,
) -> dict[tuple[str, str], str]:
    """Every import that goes up or sideways: (module, what it imports) -> the rule."""
    layers = LAYERS if layers is None else layers
    rules = RULES if rules is None else rules
    found = modules(root)
    breaks = {}
    for name, targets in import_graph(root).items():
        layer = layer_of(name, found[name], layers)
        for target in sorted(targets):
            other = layer_of(target, found[target], layers)
            if layer is None or other is None or other == layer or other in layers[layer]:
                continue  # unplaced ones are unplaced()'s to name
            breaks[name, target] = (
                f"{layer} may not import {other}: {rules.get(layer, 'imports go downwards')}"
            )
    return breaks


def crowded_folders(root: Path = ROOT) -> dict[str, int]:
    """Packages whose folder holds more than MAX_FOLDER_MODULES modules."""
    counts = {p: len(list(folder.glob("*.py"))) for p, folder in package_dirs(root).items()}
    return {p: n for p, n in counts.items() if n > MAX_FOLDER_MODULES}


def long_modules(root: Path = ROOT) -> dict[str, int]:
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules(root).items()}
    return {name: n for name, n in lengths.items() if n > MAX_LINES}


def long_functions(root: Path = ROOT) -> dict[str, int]:
    """Functions (methods included, by their enclosing function's or class's name) over
    MAX_FUNCTION_LINES, by dotted name."""
    found = {}
    for module, path in modules(root).items():

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    name = f"{prefix}.{child.name}"
                    length = child.end_lineno - child.lineno + 1
                    if not isinstance(child, ast.ClassDef) and length > MAX_FUNCTION_LINES:
                        found[name] = length
                    visit(child, name)

        visit(ast.parse(path.read_text()), module)
    return found


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 100, "the product's modules were not found"
    found = circles(graph)
    ties = [
        " -> ".join(c)
        + "  ("
        + "; ".join(f"{a} imports {sorted(graph[a] & set(c))}" for a in c)
        + ")"
        for c in found
    ]
    assert not found, (
        "import circles (move the piece both sides need down into a module of its own; "
        "an import inside a function still counts):\n" + "\n".join(ties)
    )


def test_imports_go_downwards_only():
    assert not unplaced(), (
        "not in the layer table (place each package, and each module of the ground, in "
        f"LAYERS as docs/architecture.md's 'Which way imports go' draws it): {unplaced()}"
    )
    found = layer_breaks()
    new = {pair: rule for pair, rule in found.items() if pair not in KNOWN_LAYER_BREAKS}
    assert not new, (
        "imports that go up or sideways (move what both need down, or pass it in from "
        "the caller; an import inside a function still counts):\n"
        + "\n".join(f"{a} imports {b}: {rule}" for (a, b), rule in sorted(new.items()))
    )


def test_each_known_layer_break_is_still_there():
    mended = sorted(set(KNOWN_LAYER_BREAKS) - set(layer_breaks()))
    assert not mended, f"no longer breaks its layer: take it off KNOWN_LAYER_BREAKS: {mended}"


def test_no_folder_over_the_limit():
    assert not crowded_folders(), (
        f"folders over {MAX_FOLDER_MODULES} modules (a sub-package for the subject that "
        f"grew): {crowded_folders()}"
    )


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The layer check itself, on a small tree: an upward import hidden in a function, a
    sideways one under TYPE_CHECKING, a package the table does not place, a crowded folder."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pkg", "pkg.low", "pkg.high", "pkg.side"]\n'
        '[tool.setuptools.package-dir]\n"pkg" = "pkg"\n'
    )
    for package in ("low", "high", "side"):
        (tmp_path / "pkg" / package).mkdir(parents=True)
        (tmp_path / "pkg" / package / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "base.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "high" / "a.py").write_text("from pkg.low.b import y\n")
    (tmp_path / "pkg" / "low" / "b.py").write_text("from ..base import x\ny = x\n")
    layers = {
        "pkg": {"pkg.base"},
        "pkg.base": set(),
        "pkg.high": {"pkg.base", "pkg.low"},
        "pkg.low": {"pkg.base"},
        "pkg.side": {"pkg.base"},
    }
    rules = {"pkg.low": "low stays low"}
    assert layer_breaks(tmp_path, layers, rules) == {} and unplaced(tmp_path, layers) == []
    (tmp_path / "pkg" / "low" / "c.py").write_text("def f():\n    from pkg.high.a import y\n")
    (tmp_path / "pkg" / "side" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low import b\n"
    )
    assert layer_breaks(tmp_path, layers, rules) == {
        ("pkg.low.c", "pkg.high.a"): "pkg.low may not import pkg.high: low stays low",
        ("pkg.side.d", "pkg.low.b"): "pkg.side may not import pkg.low: imports go downwards",
    }
    # A new package, and a module beside the top one's named modules, are not placed.
    (tmp_path / "pkg" / "new").mkdir()
    (tmp_path / "pkg" / "new" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "loose.py").write_text("")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pkg", "pkg.low", "pkg.high", "pkg.side", "pkg.new"]\n'
        '[tool.setuptools.package-dir]\n"pkg" = "pkg"\n'
    )
    assert unplaced(tmp_path, layers) == ["pkg.loose", "pkg.new"]
    assert crowded_folders(tmp_path) == {}
    for i in range(MAX_FOLDER_MODULES - 2):  # the __init__.py and b.py are there already
        (tmp_path / "pkg" / "low" / f"m{i}.py").write_text("")
    assert crowded_folders(tmp_path) == {"pkg.low": MAX_FOLDER_MODULES + 1}


def test_no_module_over_the_limit():
    assert not long_modules(), (
        f"modules over {MAX_LINES} lines (split by subject): {long_modules()}"
    )


def test_no_function_over_the_limit():
    found = long_functions()
    new = {name: n for name, n in found.items() if name not in LONG_FUNCTIONS_TO_SPLIT}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split into named steps): {new}"
    mended = sorted(set(LONG_FUNCTIONS_TO_SPLIT) - set(found))
    assert not mended, f"within the limit now: take them off LONG_FUNCTIONS_TO_SPLIT: {mended}"


def test_the_checks_see_a_circle_and_a_long_module(tmp_path):
    """The checks themselves, on a small tree: a circle hidden in a function and under
    TYPE_CHECKING, a chain that is no circle, and a module one line over the limit."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pkg", "pkg.sub"]\n'
        '[tool.setuptools.package-dir]\n"pkg" = "src"\n'
    )
    sub = tmp_path / "src" / "sub"
    sub.mkdir(parents=True)
    (tmp_path / "src" / "__init__.py").write_text("from .a import x\n")
    (tmp_path / "src" / "a.py").write_text("from .sub import b\nx = 1\n")
    (sub / "__init__.py").write_text("")
    (sub / "b.py").write_text("def f():\n    from pkg.sub.c import y\n")
    (sub / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n"
    )
    (sub / "d.py").write_text("from . import c\n" + "pass\n" * MAX_LINES)
    short, long = "    x = 1\n" * (MAX_FUNCTION_LINES - 1), "        x = 1\n" * MAX_FUNCTION_LINES
    (sub / "e.py").write_text(f"def short():\n{short}\nclass K:\n    def long(self):\n{long}")
    graph = import_graph(tmp_path)
    assert graph["pkg.sub.d"] == {"pkg.sub.c"} and graph["pkg"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert long_modules(tmp_path) == {"pkg.sub.d": MAX_LINES + 1}
    assert long_functions(tmp_path) == {"pkg.sub.e.K.long": MAX_FUNCTION_LINES + 1}
    (sub / "c.py").write_text("y = 2\n")
    assert circles(import_graph(tmp_path)) == []


def layout_names(doc: str) -> dict[str, set[str]]:
    """The file names docs/architecture.md's layout tree gives each folder: the tree is
    the first code block after '## Layout', two spaces of indent per level, a folder
    ending in '/', its files (and any `name.py` its lines mention) below it."""
    block = doc.split("## Layout", 1)[1].split("```", 2)[1]
    names: dict[str, set[str]] = {}
    stack: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        first = line.split()[0]
        if first.endswith("/") and indent <= len(stack):
            stack = [*stack[:indent], first.rstrip("/")]
            names.setdefault("/".join(stack), set())
            continue
        folder = "/".join(stack[: min(indent, len(stack))] or stack)
        names.setdefault(folder, set()).update(re.findall(r"\b(\w+\.py)\b", line))
    return names


def test_the_architecture_doc_lists_every_module_where_it_lives():
    """A module added, moved or renamed shows in the layout tree, or this fails."""
    names = layout_names((ROOT / "docs" / "architecture.md").read_text())
    missing = []
    for package, folder in package_dirs().items():
        rel = folder.relative_to(ROOT).as_posix()
        for path in sorted(folder.glob("*.py")):
            if path.name != "__init__.py" and path.name not in names.get(rel, set()):
                missing.append(f"{rel}/{path.name}")
        if rel not in names and package not in ("overnight",):
            missing.append(f"{rel}/")
    assert not missing, f"docs/architecture.md's layout does not list: {missing}"
