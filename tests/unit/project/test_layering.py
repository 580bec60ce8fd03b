"""The dependency rules of the layout, read from the imports themselves (docs/architecture.md).

Layers: the core nouns (the modules directly in kvtier/) <- store <- security, planning <- the
storage backends <- server, connectors. Every import statement counts, lazy ones inside functions
and those under ``if TYPE_CHECKING:`` included: a rule that only holds at run time is no rule.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROJECT = ("kvtier", "storage_backends", "connectors", "benchmarks")

CORE = "kvtier (core nouns)"
#: What each part may import from the project (itself always).
ALLOWED: dict[str, set[str]] = {
    CORE: set(),
    "kvtier.store": {CORE},
    "kvtier.transfer": {CORE},
    "kvtier.rpc": {CORE},
    "kvtier.dataplane": {CORE, "kvtier.rpc", "kvtier.store", "kvtier.security"},
    "kvtier.engine": {CORE, "kvtier.transfer"},
    "kvtier.security": {CORE, "kvtier.store"},
    "kvtier.planning": {CORE, "kvtier.store"},
    "kvtier.cache": {CORE, "kvtier.store", "kvtier.security"},
    "storage_backends": {CORE, "kvtier.store", "kvtier.security", "kvtier.transfer", "kvtier.rpc",
                         "kvtier.dataplane"},
    "kvtier.server": {CORE, "kvtier.store", "kvtier.security", "kvtier.planning", "kvtier.cache", "kvtier.rpc",
                      "kvtier.transfer", "kvtier.dataplane"},
    "connectors": {CORE, "kvtier.store", "kvtier.security", "kvtier.planning", "kvtier.cache", "kvtier.rpc",
                   "kvtier.transfer", "kvtier.dataplane", "kvtier.engine", "kvtier.server", "storage_backends"},
    # The router (`kvtier route`) asks the daemons through the server's fleet view.
    "kvtier.router": {CORE, "kvtier.server"},
    "kvtier.cli": {CORE, "kvtier.store", "kvtier.security", "kvtier.server", "kvtier.rpc", "kvtier.router"},
    "benchmarks": {CORE, *(f"kvtier.{p}" for p in ("store", "security", "planning", "cache", "rpc", "transfer",
                                                   "engine", "server", "cli", "dataplane", "router")),
                   "storage_backends", "connectors"},
}


def part_of(module: str) -> str:
    head, _, rest = module.partition(".")
    if head != "kvtier":
        return head
    sub = rest.split(".")[0]
    return f"kvtier.{sub}" if sub and (ROOT / "kvtier" / sub).is_dir() else CORE


def modules() -> dict[str, Path]:
    out = {}
    for top in PROJECT:
        for f in (ROOT / top).rglob("*.py"):
            if "__pycache__" in f.parts or f.name.endswith("_pb2.py") or f.name.endswith("_pb2_grpc.py"):
                continue
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def imports(path: Path) -> set[str]:
    """Project modules named by every import statement of a file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PROJECT)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    g: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for target in imports(path):
            # ``from pkg import name`` names a module when pkg.name is one, else pkg itself.
            dep = target if target in mods else target.rpartition(".")[0] if target.rpartition(".")[0] in mods else None
            if dep is not None and dep != name:
                g[name].add(dep)
    return g


def test_every_part_imports_only_what_its_layer_allows() -> None:
    broken = []
    for mod, deps in graph().items():
        part = part_of(mod)
        assert part in ALLOWED, f"{mod}: part {part} has no rule; add it to ALLOWED and docs/architecture.md"
        for dep in deps:
            target = part_of(dep)
            if target != part and target not in ALLOWED[part]:
                broken.append(f"{mod} -> {dep}")
    assert not broken, "imports against the layering:\n" + "\n".join(sorted(broken))


def test_nothing_under_kvtier_imports_another_top_level_folder() -> None:
    """kvtier/ is the core: backends and harnesses are found through entry points (kvtier/plugins.py)."""
    bad = [f"{m} -> {d}" for m, ds in graph().items() if m.startswith("kvtier") for d in ds
           if d.split(".")[0] != "kvtier"]
    assert not bad, bad


def test_nothing_under_kvtier_names_benchmarks_or_storage_backends_as_a_module() -> None:
    """Not even as a string for importlib: a name in a string is an import no check would see."""
    pattern = re.compile(r"\b(benchmarks|storage_backends|connectors)\.(?!md\b)[a-z_]+")
    bad = [f"{path.relative_to(ROOT)}: {m.group(0)}" for name, path in modules().items() if name.startswith("kvtier")
           for m in pattern.finditer(path.read_text())]
    assert not bad, bad


#: The data plane's modules, both ends: they live in kvtier/dataplane/ and nowhere else.
DATAPLANE = {"region", "region_blocks", "handshake", "session", "layered_read", "listener", "region_table",
             "region_writer", "shared_pages", "slices", "typed_views"}


def test_the_data_plane_has_one_home() -> None:
    here = {p.stem for p in (ROOT / "kvtier" / "dataplane").glob("*.py")} - {"__init__"}
    assert here == DATAPLANE
    for top in PROJECT:
        for f in (ROOT / top).rglob("*.py"):
            if "dataplane" not in f.parts and f.stem in DATAPLANE - {"session"}:
                raise AssertionError(f"{f.relative_to(ROOT)}: a data-plane module outside kvtier/dataplane/")


def test_storage_backends_holds_tiers_only() -> None:
    """Every module of storage_backends/ defines a Tier or serves one (the circuit breaker of the
    S3 and daemon tiers; S3's package: its vacuum, its config, probes, objects, key mirror, revocation feed
    and its local state; the daemon's: its config, its shared channel, its Put messages, a Get's
    share of the region and its Locate client for an event loop), and none is a data-plane module."""
    import storage_backends

    tiers = {"memory", "frame_memory", "meta", "lmdb", "gpu", "grpc", "grpc_config", "grpc_channel", "grpc_put_frames",
             "grpc_get_share", "grpc_locate", "circuit_breaker"}
    s3 = {"tier", "seaweed_vacuum", "config", "probes", "objects", "key_mirror", "revocation_feed", "feed_state"}
    found = {str(f.relative_to(ROOT / "storage_backends").with_suffix("")) for f in
             (ROOT / "storage_backends").rglob("*.py") if "__pycache__" not in f.parts}
    assert found == {"__init__", *tiers, "s3/__init__", *(f"s3/{m}" for m in s3)}, found
    assert storage_backends.__file__


def test_no_import_circles_between_modules() -> None:
    g = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_rules_can_fail() -> None:
    """The checker sees a lazy import inside a function, and a layer breach in it."""
    src = "def f():\n    from kvtier.server.daemon import Daemon\n"
    tmp = ROOT / "kvtier" / "store" / "_layering_probe.py"
    tmp.write_text(src)
    try:
        deps = graph()["kvtier.store._layering_probe"]
        assert "kvtier.server.daemon" in deps
        assert part_of("kvtier.server.daemon") not in ALLOWED["kvtier.store"]
    finally:
        tmp.unlink()
