"""The repository's shape as a newcomer meets it: the two make targets, the one GPU script, bench/ as an
importable package (no sys.path edits), kept results under one naming scheme and each cited, README
tables that stay readable, and blink/ in files and functions that fit on a few screens."""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80
# CUDA math kernels whose body is one pipeline (tiles in flight, one register budget): kept whole,
# see docs/decisions.md (Engine, "CUDA function length").
WHOLE_CUDA_FUNCTIONS = {
    "attn_flash_impl",
    "attn_flashmma_impl",
    "attn_prefill_fa2_impl",
    "gemv_fused_impl",
    "moe_expert_mma_impl",
    "rope_kv_write_impl",
}
CUDA_NOT_A_FUNCTION = re.compile(r"^(#|//|/\*|\*|}|namespace\b|struct\b|class\b|union\b|enum\b|typedef\b|using\b)")
CUDA_ATTRIBUTES = {"__launch_bounds__", "__align__", "__attribute__", "alignas", "decltype"}
NAME = re.compile(r"^[a-z0-9_]+-(h200|2xh200|emulated|cpu)-[0-9a-f]{7}\.(json|log|png)$")


def _make(*args: str) -> str:
    return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_make_serve_takes_a_port_and_passes_flags_on():
    assert "blink serve --host 127.0.0.1 --port 8000" in _make("serve")
    assert "blink serve --host 127.0.0.1 --port 8123 --max-num-seqs 8" in _make(
        "serve", "PORT=8123", "ARGS=--max-num-seqs 8"
    )


def test_make_gpu_test_runs_the_gpu_script_on_the_tests():
    out = _make("gpu-test", "OUT=/tmp/gpu", "COMMIT=abc1234")
    assert "bash scripts/gpu_check.sh --commit abc1234 /tmp/gpu tests conformance" in out
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert 'part tests 1800 "${PT[@]}" -m gpu tests' in script  # the gpu-marked tests, not a benchmark


def test_ci_runs_exactly_make_test():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.findall(r"^make .*$", ci, re.M) == ['make test PYTEST_ARGS="-q --durations=15"']


def _make_n_test(**env: str) -> str:
    """What `make test` would run (make -n), under this environment plus `env`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")} | env
    return subprocess.run(["make", "-n", "test"], cwd=ROOT, env=full, capture_output=True, text=True, check=True).stdout


def test_make_test_caches_bytecode_whatever_the_environment_says():
    """The suite starts hundreds of Python processes (servers, devices, Ray workers). The install skips
    byte-compiling (--no-compile), so the first import of a module must write its .pyc: with
    PYTHONDONTWRITEBYTECODE=1 in the environment (CI's) every process compiled ray, aiohttp, numpy and
    blink from source again (`import ray`: 2.3 s of CPU instead of 1.0 s), 9 minutes of CPU a run."""
    out = _make_n_test(PYTHONDONTWRITEBYTECODE="1")
    runs = [ln for ln in out.splitlines() if re.search(r"/(pytest|blink) ", ln)]
    assert len(runs) == 2, out  # blink pull, pytest
    assert all(ln.startswith("env -u PYTHONDONTWRITEBYTECODE ") for ln in runs), runs


def test_make_test_runs_blas_and_torch_on_one_thread_per_process():
    """Two workers fill two cores; a BLAS or torch pool of two threads in each process spins beside
    the other worker (the transformers reference: 24.7 s on one thread, 57.6 s on two, next to a
    busy core)."""
    (run,) = [ln for ln in _make_n_test().splitlines() if "/pytest " in ln]
    words = run.split()
    assert {"OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1", "MKL_NUM_THREADS=1"} <= set(
        words[: words.index(".venv/bin/pytest")]
    )


def test_the_long_files_that_start_first_exist():
    import importlib.util

    # by path: `conftest` names tests/conformance/conftest.py too, whichever a worker imported first
    spec = importlib.util.spec_from_file_location("blink_tests_conftest", ROOT / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    LONG_FILES = mod.LONG_FILES
    assert len(set(LONG_FILES)) == len(LONG_FILES)
    assert all((ROOT / "tests" / f).is_file() for f in LONG_FILES), LONG_FILES


def test_no_sys_path_edits_in_bench_or_tests():
    for p in [*ROOT.glob("bench/**/*.py"), *ROOT.glob("tests/**/*.py")]:
        if p != Path(__file__):
            assert "sys.path.insert" not in p.read_text() and "sys.path.append" not in p.read_text(), p


def test_kept_results_follow_one_scheme_and_are_cited():
    cited = "".join((ROOT / f).read_text() for f in ("README.md", "bench/results/README.md", "docs/decisions.md"))
    kept = [p for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"]
    assert kept
    for p in kept:
        assert NAME.match(p.name), p.name
        assert p.name in cited, (
            f"{p.name} is cited by neither the README, bench/results/README.md nor docs/decisions.md"
        )


def test_readme_table_rows_stay_short():
    for f in ("README.md", "bench/README.md", "bench/results/README.md", "docs/decisions.md"):
        for i, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            if line.lstrip().startswith("|"):
                assert len(line) <= 300, f"{f}:{i} is {len(line)} characters"


def test_test_modules_have_unique_basenames():
    """pytest imports test files by basename (tests/ has no packages): two files of one name in
    different folders stop the whole collection with "import file mismatch"."""
    root = Path(__file__).parent
    names = [p.name for p in root.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def _too_long(root: Path) -> list[str]:
    """Every .py file under root over MAX_FILE_LINES and every function (decorators included) over
    MAX_FUNCTION_LINES, as "path: N lines" / "path:line name: N lines"."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text, rel = path.read_text(), path.relative_to(root)
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            out.append(f"{rel}: {n} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:  # type: ignore[operator]
                    out.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return out


def _cuda_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function defined at column 0 of a CUDA/C source: its
    signature (a template line and indented continuation lines included) through the first "}"
    alone on a line after it. Macro bodies, structs and their members are not counted."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i] or lines[i][0].isspace() or CUDA_NOT_A_FUNCTION.match(lines[i]):
            i += 1
            continue
        j, head = i, lines[i]
        while "{" not in head and not head.rstrip().endswith(";") and j + 1 < len(lines):
            if not (lines[j + 1][:1].isspace() or lines[j].startswith("template")):
                break
            j += 1
            head += " " + lines[j].strip()
        stmt = re.sub(r"^template\s*<[^>]*>\s*", "", head)
        names = [n for n in re.findall(r"([A-Za-z_]\w*)\s*\(", stmt) if n not in CUDA_ATTRIBUTES]
        end = next((k for k in range(j + 1, len(lines)) if lines[k] == "}"), None)
        if not head.rstrip().endswith("{") or "=" in stmt.split("(")[0] or not names or end is None:
            i = j + 1
            continue
        out.append((names[0], i + 1, end - i + 1))
        i = end + 1
    return out


def _too_long_cuda(root: Path) -> list[str]:
    """Every CUDA/C function under root over MAX_FUNCTION_LINES but those of WHOLE_CUDA_FUNCTIONS."""
    return [
        f"{path.relative_to(root)}:{line} {name}: {n} lines"
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh", ".h"))
        for name, line, n in _cuda_functions(path.read_text())
        if n > MAX_FUNCTION_LINES and name not in WHOLE_CUDA_FUNCTIONS
    ]


def test_blink_has_no_file_over_600_lines_and_no_function_over_80():
    assert _too_long(ROOT / "blink") == []


def test_the_length_check_finds_a_long_file_and_a_long_function(tmp_path: Path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f"@staticmethod\ndef f():\n{body}\n\nasync def g():\n    pass\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (tmp_path / "ok.py").write_text("def h():\n" + body[: body.index("\n") + 1] * (MAX_FUNCTION_LINES - 1))
    assert _too_long(tmp_path) == ["big.py: 601 lines", "pkg/long.py:2 f: 82 lines"]


def test_blink_has_no_cuda_function_over_80_but_the_whole_math_kernels():
    assert _too_long_cuda(ROOT / "blink") == []
    found = {name for p in ROOT.joinpath("blink").rglob("*.cu*") for name, _, _ in _cuda_functions(p.read_text())}
    assert WHOLE_CUDA_FUNCTIONS <= found  # the list names functions that exist


def test_the_cuda_length_check_finds_a_long_function(tmp_path: Path):
    lines = [f"  x[{i}] = {i};\n" for i in range(MAX_FUNCTION_LINES)]
    body, short = "".join(lines), "".join(lines[:-3])  # ok: exactly 80 lines
    (tmp_path / "k.cu").write_text(
        "#define M(N) \\\n  __global__ void m##N() { \\\n  }\n"  # a macro body: not counted
        "struct S {\n  int f() {\n" + body + "  }\n};\n"  # a member: not counted
        'extern "C" __global__ void __launch_bounds__(256)\n    long_kernel(int* x) {\n' + body + "}\n"
        "template <int N>\n__device__ __forceinline__ void ok(int* x) {\n" + short + "}\n"
        "template <int N>\n__device__ void attn_flash_impl(int* x) {\n" + body + "}\n"
    )
    assert _cuda_functions((tmp_path / "k.cu").read_text())[0][0] == "long_kernel"
    assert _too_long_cuda(tmp_path) == ["k.cu:88 long_kernel: 83 lines"]
