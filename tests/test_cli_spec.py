"""Generated artefacts are fresh, the snapshot review reads well, the operator CLI behaves."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sfa_rd2h.runtime.tools.cli import main
from sfa_rd2h.spec import invariants
from sfa_rd2h.statemachines import render, snapshot

REPO = Path(__file__).resolve().parent.parent


def test_committed_diagrams_are_fresh(capsys):
    assert main(["diagrams", "--check"]) == 0
    assert "match the machines" in capsys.readouterr().out


def test_diagram_check_detects_a_stale_file(tmp_path, capsys):
    from sfa_rd2h.runtime.tools import sequence

    render.write_diagrams(tmp_path, svg=False)
    sequence.write_example(tmp_path, svg=False)
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 0
    dot = tmp_path / "request_status.dot"
    dot.write_text(dot.read_text().replace("tp_agreed", "tp_agreed_by_hand", 1))
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 1
    assert "request_status" in capsys.readouterr().err


def test_diagrams_are_deterministic_and_svg_renders(tmp_path):
    first = {s: render.dot_source(s) for s in render.MACHINES}
    assert first == {s: render.dot_source(s) for s in render.MACHINES}
    render.write_diagrams(tmp_path)
    svg = (tmp_path / "prefill_slot.svg").read_text()
    assert "<svg" in svg and "awaiting_replies" in svg


def test_committed_snapshot_is_fresh():
    assert snapshot.is_fresh(), "run 'sfa-rd2h spec export' and commit spec/snapshot.json"
    assert main(["spec", "export", "--check"]) == 0


def test_snapshot_covers_every_rule_of_protocol_md():
    """The in-repo reference (generated) and the snapshot name exactly the catalog's rules."""
    import re

    text = (REPO / "spec" / "PROTOCOL.md").read_text()
    ids = {r.id for r in invariants.RULES}
    declared = re.findall(r"^### ([A-Z]\d+)$", text, re.M)
    assert sorted(declared) == sorted(ids) and len(declared) == len(set(declared))
    exported = snapshot.export_spec()
    assert set(exported["invariants"]) == ids
    assert set(exported["machines"]) == {"prefill_slot", "decode_layer_read", "request_status",
                                         "peer_session"}
    assert [f["name"] for f in exported["wire"]["READ_READY_BATCH"]["fields"]] == [
        "layer_idx", "layer_name", "read_reqs", "done_ext_ids", "group_member_idx", "tp_ratio"]


def test_every_named_check_resolves():
    for rule in invariants.RULES:
        for check in rule.checks:
            assert callable(invariants.resolve(check)), check


def test_spec_diff_reviews_changes(tmp_path, capsys):
    old = snapshot.export_spec()
    new = copy.deepcopy(old)
    slot = new["machines"]["prefill_slot"]
    slot["transitions"] = [t for t in slot["transitions"] if t["trigger"] != "observe_error"]
    slot["states"].append({"name": "draining", "doc": "new", "final": False})
    new["machines"]["request_status"]["transitions"][0]["unless"] = []
    new["wire"]["READ_DONE"]["fields"].append({"name": "epoch", "type": "int"})
    new["invariants"]["S1"]["text"] = "changed"
    del new["invariants"]["X2"]
    a, b = tmp_path / "old.json", tmp_path / "new.json"
    a.write_text(snapshot.dumps(old))
    b.write_text(snapshot.dumps(new))
    assert main(["spec", "diff", str(a), str(b), "--exit-code"]) == 1
    out = capsys.readouterr().out
    assert "- removed transition failed --observe_error--> free" in out
    assert "+ added state draining" in out
    assert "registered --contributor_final--> local_failed" in out  # guard dropped
    assert "~ changed message READ_DONE" in out and "epoch:int" in out
    assert "~ changed rule S1" in out and "- removed rule X2" in out
    assert main(["spec", "diff", str(a), str(a)]) == 0
    assert "no protocol changes" in capsys.readouterr().out


def test_plan_json(capsys):
    assert main(["plan", "--p-tp", "4", "--d-tp", "2", "--kv-port", "30000",
                 "--d-dp-rank", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prefill"][3] == {"p_rank": 3, "d_rank": 1, "group_member_idx": 1,
                                    "tp_ratio": 2, "remote_port": 30003}
    assert result["decode"] == [{"d_rank": 0, "port": 30002}, {"d_rank": 1, "port": 30003}]


@pytest.mark.parametrize("args, rule", [
    (["--p-tp", "3", "--d-tp", "2", "--kv-port", "30000"], "T1"),
    (["--p-tp", "2", "--d-tp", "4", "--kv-port", "30000"], "T1"),
    (["--p-tp", "2", "--d-tp", "2", "--kv-port", "65535"], "P2"),
    (["--p-tp", "2", "--d-tp", "2", "--kv-port", "0"], "P1"),
])
def test_plan_rejects_invalid(args, rule, capsys):
    assert main(["plan", *args]) != 0
    assert rule in capsys.readouterr().err


def test_only_the_namespaced_package_is_importable(tmp_path):
    code = "import sfa_rd2h.spec, sfa_rd2h.runtime.tools.cli\ntry:\n    import spec\nexcept " \
           "ModuleNotFoundError:\n    print('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_console_script_runs():
    exe = Path(sys.executable).parent / "sfa-rd2h"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    for command in ("diagrams", "spec", "plan"):
        assert command in out.stdout


def test_every_source_package_is_packaged():
    import tomllib

    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(conf["packages"])
    found = set()
    for name, folder in conf["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((name, *rel)))
    assert found == declared
