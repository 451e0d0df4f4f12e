"""The package layers (README, rule 3): protocol/ imports nothing of blink's but itself; the frontend
(dpu/) and the devices (device/, gpu/) never import each other, nor anything above them (the launch
layer, actors/, the CLI). The launch layer's device side (launch.py) and the testing helper (testing.py)
are checked too. Imports are read from the source (function-level lazy ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BLINK = Path(__file__).resolve().parent.parent / "blink"


def blink_imports(package: str) -> dict[str, set[str]]:
    """{file: the blink modules it imports}, for every .py file under blink/<package> (or that one file)."""
    out: dict[str, set[str]] = {}
    base = BLINK / package
    for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
        here = ["blink", *path.relative_to(BLINK).with_suffix("").parts]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = here[: len(here) - node.level]
                    names.add(".".join(base + ([node.module] if node.module else [])))
                else:
                    names.add(node.module or "")
        out[str(path.relative_to(BLINK))] = {n for n in names if n == "blink" or n.startswith("blink.")}
    return out


def offenders(package: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    def ok(mod: str) -> bool:
        return any(mod == a or (a != "blink" and mod.startswith(a + ".")) for a in allowed)

    return {
        f: sorted(m for m in mods if not ok(m))
        for f, mods in blink_imports(package).items()
        if any(not ok(m) for m in mods)
    }


@pytest.mark.parametrize(
    "package, allowed",
    [
        ("protocol", ("blink.protocol",)),
        # models: configs, loaders and the numpy reference, below every device
        ("models", ("blink.models", "blink.protocol")),
        # "blink": the package root, for __version__
        ("dpu", ("blink.dpu", "blink.protocol", "blink.config", "blink.models", "blink")),
        ("device", ("blink.device", "blink.protocol", "blink.models")),
        ("gpu", ("blink.gpu", "blink.device", "blink.protocol", "blink.models")),
        # the launch layer's device side: the spec, the ring, the device process (no frontend)
        ("launch.py", ("blink.config", "blink.protocol")),
        # drives `blink serve` from outside (a child process, HTTP): runs the blink it belongs to
        ("testing.py", ()),
    ],
)
def test_layer_imports_only_what_lies_below_it(package: str, allowed: tuple[str, ...]) -> None:
    assert offenders(package, allowed) == {}


def test_the_check_sees_a_wrong_way_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "dpu"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from ..gpu import serve\n    import blink.device.emulated\n")
    monkeypatch.setattr(__import__(__name__), "BLINK", tmp_path)
    assert offenders("dpu", ("blink.dpu",)) == {"dpu/x.py": ["blink.device.emulated", "blink.gpu"]}


def test_the_check_reads_a_single_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "launch.py").write_text("import blink.dpu.server\nfrom blink.protocol import layout\n")
    monkeypatch.setattr(__import__(__name__), "BLINK", tmp_path)
    assert offenders("launch.py", ("blink.protocol",)) == {"launch.py": ["blink.dpu.server"]}
