"""The layout's rules, checked on the source: no import circle among the project's modules (function-level imports
included), nothing outside tests/ imports tests/, bench/ holds benchmarks only (it imports no driver), and no
driver edits sys.path."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "experiments", "perf", "pretrain", "tests")


def project_modules() -> dict[str, Path]:
    mods = {p.stem: p for p in ROOT.glob("*.py")}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).glob("*.py"):
            mods[pkg if p.stem == "__init__" else f"{pkg}.{p.stem}"] = p
    return mods


def imports_of(path: Path, mods: dict) -> set[str]:
    """Project modules a file imports anywhere in it (`from bench import toyworld` counts as bench.toyworld)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in mods}
    return out


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    g = {}
    for name, path in mods.items():
        deps = imports_of(path, mods) - {name}
        g[name] = {d for d in deps if not name.startswith(d + ".")}   # a package's submodule may import its package
    return g


def test_no_import_circle():
    g = {m: d for m, d in graph().items() if not m.startswith("tests")}
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(g.get(m, ())):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(g):
        visit(m, [])


def test_only_tests_import_tests_and_bench_imports_no_driver():
    for module, deps in graph().items():
        if not module.startswith("tests"):
            assert not {d for d in deps if d.startswith("tests")}, module
        if module.startswith("bench"):
            assert not {d for d in deps if d.split(".")[0] in ("experiments", "perf", "train", "evaluate")}, module


def test_no_sys_path_surgery():
    for pkg in ("bench", "experiments", "perf", "pretrain"):
        for p in (ROOT / pkg).glob("*.py"):
            assert "sys.path" not in p.read_text(), p


CORE = ("rollout", "kvbatch", "rehearse", "reward", "train", "evaluate", "grpo", "warm_start", "chat_format", "policy")
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/tmp/|/home/|/root/|/Users/|/opt/|/mnt/|[A-Z]:\\)")


def test_the_cache_and_the_loss_import_no_engine():
    """kvbatch.py (the KV-cache machinery) imports nothing of the project; grpo.py (the loss) only the role ids."""
    g = graph()
    assert g["kvbatch"] == set(), g["kvbatch"]
    assert g["grpo"] <= {"roles"}, g["grpo"]
    assert g["roles"] == set()


def test_core_modules_stay_readable_in_size():
    sizes = {m: len((ROOT / f"{m}.py").read_text().splitlines()) for m in CORE}
    assert sizes["rollout"] < 850 and max(sizes.values()) < 900, sizes


def test_results_and_docs_hold_no_machine_paths():
    """Committed results and docs name paths relative to the project or the run folder, never this host's."""
    files = [p for top in ("results", "docs") for p in (ROOT / top).rglob("*")
             if p.is_file() and p.suffix in (".json", ".jsonl", ".md", ".txt", ".csv", ".sh", ".toml")]
    files.append(ROOT / "README.md")
    assert len(files) > 50
    bad = {}
    for p in files:
        hits = MACHINE_PATH.findall(p.read_text(errors="replace"))
        if hits:
            bad[str(p.relative_to(ROOT))] = sorted(set(hits))
    assert not bad, bad


def test_the_checker_sees_a_machine_path():
    assert MACHINE_PATH.search('"model": "/work/main/runs/x"') and MACHINE_PATH.search("C:\\runs")
    assert not MACHINE_PATH.search('"model": "runs/ws/ckpt/step_000400"') and not MACHINE_PATH.search("a/tmp/b")


def test_the_core_branches_on_no_benchmark_by_name():
    """train.py, evaluate.py and rollout.py ask a benchmark's settings and capabilities, never its name."""
    from bench import BENCHES
    for module in ("train", "evaluate", "rollout"):
        tree = ast.parse((ROOT / f"{module}.py").read_text())
        names = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in BENCHES]
        assert not names, (module, names)
