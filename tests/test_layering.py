"""The import arrows point one way: spec -> tables -> cores -> drivers -> tools.

Every ``sfa_rd2h`` import in the source tree, including the lazy ones inside functions, is
read with ``ast`` and checked against the layer of the importing module, so a new upward
import fails here with the file and line that made it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sfa_rd2h.model_check import invariants as mc_invariants
from sfa_rd2h.spec import invariants

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"spec": "sfa_rd2h.spec", "statemachines": "sfa_rd2h.statemachines",
           "runtime": "sfa_rd2h.runtime", "model_check": "sfa_rd2h.model_check"}

# (layer, name): most specific prefix wins. The two drivers share a layer but must not
# import each other.
LAYERS = [
    ("sfa_rd2h.spec", 0, "spec"),
    ("sfa_rd2h.statemachines", 1, "tables"),
    ("sfa_rd2h.statemachines.cores", 2, "cores"),
    ("sfa_rd2h.statemachines.trace", 2, "cores"),
    ("sfa_rd2h.model_check", 3, "model checker"),
    ("sfa_rd2h.runtime", 3, "runtime"),
    ("sfa_rd2h.runtime.tools", 4, "tools"),
]


def layer_of(module: str) -> tuple[int, str]:
    best = max((p for p in LAYERS if module == p[0] or module.startswith(p[0] + ".")),
               key=lambda p: len(p[0]))
    return best[1], best[2]


def source_modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            # `from pkg import submodule` imports the submodule too
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return [(name, line) for name, line in found if name.startswith("sfa_rd2h.")]


MODULES = source_modules()


def test_every_source_module_has_a_layer():
    assert len(MODULES) > 30
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine, my_name = layer_of(module)
    bad = []
    for target, line in imports_of(module, MODULES[module]):
        if target not in MODULES and target.rpartition(".")[0] not in MODULES:
            continue  # a name imported from a module, already checked as that module
        if target not in MODULES:
            target = target.rpartition(".")[0]
        theirs, their_name = layer_of(target)
        if theirs > mine or (theirs == mine == 3 and their_name != my_name):
            bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} ({my_name}) imports "
                       f"{target} ({their_name})")
    assert not bad, "\n".join(bad)


def test_engine_interface_does_not_know_the_engines():
    names = {t for t, _ in imports_of("sfa_rd2h.runtime.engines.base",
                                      MODULES["sfa_rd2h.runtime.engines.base"])}
    concrete = {"host", "memfabric", "mooncake", "fake_memfabric", "factory"}
    assert not {n.rpartition(".")[2] for n in names} & concrete


def test_no_private_names_cross_modules():
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sfa_rd2h"):
                bad += [f"{module} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
    assert not bad, bad


def test_upward_layer_import_is_detected(tmp_path):
    # The checker itself must be able to fail: a cores module importing the runtime.
    fake = tmp_path / "bad.py"
    fake.write_text("from sfa_rd2h.runtime.control import DecodeWorker\n")
    targets = imports_of("sfa_rd2h.statemachines.cores.bad", fake)
    assert ("sfa_rd2h.runtime.control", 1) in targets
    assert layer_of(targets[0][0])[0] > layer_of("sfa_rd2h.statemachines.cores.bad")[0]


def test_behavioural_rules_are_judged_by_registered_predicates():
    # The catalog names rules; the checker registers its predicates against them from above.
    for rule_id, names in mc_invariants.PREDICATES.items():
        assert rule_id in invariants.BY_ID
        for name in names:
            assert callable(getattr(mc_invariants, name))
    judged = set(mc_invariants.PREDICATES)
    for rule_id in ("W1", "S1", "S2", "S3", "S4", "S5", "R1", "R2", "R3", "R4", "R5", "L1",
                    "T2", "T3", "T4", "C4", "F2"):
        assert rule_id in judged, rule_id


def test_registering_an_unknown_rule_fails():
    with pytest.raises(KeyError, match="Z9"):
        mc_invariants.judges("Z9")(lambda: None)
