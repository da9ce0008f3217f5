"""What a non-editable install and the serving image get: the shipped drafters are found, and the
serving code imports none of the training, benchmark, test or lint tools."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# tqdm and httpx also come with transformers / huggingface-hub; these must not come with serving.
DEV_ONLY = ("pytest", "ruff", "scipy", "matplotlib", "hypothesis", "schemathesis", "openai")


def _names(path: Path) -> set[str]:
    lines = [x.strip() for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return {re.split(r"[=<>\[ ]", x)[0].lower().replace("_", "-") for x in lines}


def test_serving_requirements_carry_no_dev_tools() -> None:
    serving, dev = _names(REPO_ROOT / "requirements.txt"), _names(REPO_ROOT / "requirements-dev.txt")
    assert not serving & set(DEV_ONLY), serving & set(DEV_ONLY)
    assert set(DEV_ONLY) <= dev and {"tqdm", "httpx"} <= dev
    pinned = _names(REPO_ROOT / "constraints.txt")
    assert (serving | dev) <= pinned | {"jinja2"}


def _imports(package: str, full: bool = False) -> dict[str, set[str]]:
    """Top-level modules (`full`: the whole dotted names) imported anywhere, function bodies
    included, by each file of a package."""
    found: dict[str, set[str]] = {}
    for path in (REPO_ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO_ROOT))] = names if full else {n.split(".")[0] for n in names}
    return found


def test_serving_code_imports_no_dev_tools_and_no_trainer() -> None:
    """app/ and model/ (what the image serves) import no dev-only tool, and never train/ or bench/."""
    forbidden = set(DEV_ONLY) | {"tqdm", "httpx", "train", "bench"}
    for package in ("app", "model"):
        bad = {f: names & forbidden for f, names in _imports(package).items() if names & forbidden}
        assert not bad, bad
    # Benchmarks use model/, not the trainer. The one exception is the prompt sources they share with
    # it (train/data.py): bench/prompts/build.py writes the held-out complement of training's split.
    trainer = {
        f: {n for n in names if n.split(".")[0] == "train" and n != "train.data"}
        for f, names in _imports("bench", full=True).items()
    }
    bench = {f: names for f, names in trainer.items() if names}
    assert not bench, bench


@pytest.mark.slow
def test_wheel_install_finds_shipped_drafters(tmp_path: Path) -> None:
    """A wheel (not editable) installed into a fresh venv, run away from the checkout, serves the
    embedded default's drafters from <prefix>/share/domino-serve/drafters."""
    wheels = tmp_path / "wheels"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "DOMINO_"))}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(REPO_ROOT),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(wheels.glob("domino_serve-*.whl"))
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # --ignore-installed: without it pip, seeing this environment's editable install, uninstalls it
    # (and its `domino-serve` script) before installing into the prefix.
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--ignore-installed",
            "--prefix",
            str(venv),
            str(wheel),
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    # Dependencies (torch, transformers, ...) come from this test's environment, as a base image's do.
    run_env = {**env, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    code = """
import sys
from model.load.loading import DEFAULT_DRAFTER_DIR, DEFAULT_DFLASH_DRAFTER_DIR
from model.load.checkpoint import load_drafter
for path in (DEFAULT_DRAFTER_DIR, DEFAULT_DFLASH_DRAFTER_DIR):
    assert str(path).startswith(sys.prefix), (path, sys.prefix)
    print(path, load_drafter(path).config.block_size)
import model
print(model.__file__)
"""
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(venv) in proc.stdout.splitlines()[-1]  # the installed copy, not the checkout
    assert proc.stdout.count("share/domino-serve/drafters/smollm2-135m-") == 2
    # The developer's environment still has its own install (`make serve` runs its script).
    assert (Path(sys.executable).parent / "domino-serve").exists()


# The wire side: what the worker hands results through, and everything that only reads requests
# and events. None of it may pull in torch or the engine (model/engine/requests.py is the torch-free half).
WIRE_SIDE = (
    "app.events",
    "app.protocol",
    "app.errors",
    "app.detokenize",
    "app.metrics",
    "app.reasoning",
    "app.tool_parser",
    "app.tool_prompt",
    "app.chat_output",
    "app.partial",
    "app.nesting",
    "app.middleware",
    "app.settings",
    "model.engine.requests",
)


def test_wire_side_types_import_no_torch_and_no_engine() -> None:
    code = (
        "import sys\n"
        f"for name in {WIRE_SIDE!r}:\n"
        "    __import__(name)\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')} | "
        "{m for m in sys.modules if m in ('model.engine.engine', 'model.nn.target', 'model.nn.drafter', "
        "'model.engine.grammar', 'app.worker')})\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _module_imports(path: Path) -> set[str]:
    """Project modules a file imports at module level, `if TYPE_CHECKING:` included (a type-only
    circle is still a circle for a reader); imports inside functions are deferred on purpose."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        for sub in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                names.add(sub.module)
                names |= {f"{sub.module}.{alias.name}" for alias in sub.names}
            elif isinstance(sub, ast.Import):
                names |= {alias.name for alias in sub.names}
    return names


def test_no_import_cycles() -> None:
    modules: dict[str, Path] = {}
    for package in ("app", "model", "train", "bench"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: {m for m in _module_imports(path) if m in modules and m != name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


TRACKED_TREE_LIMIT = 30 * 2**20  # the repository's bound on its tracked files; results are kept compact


def test_tracked_tree_stays_under_its_limit() -> None:
    """Every tracked file together (weights, data shards, results, plots) stays within 30 MiB: what
    a clone and the device machine's upload carry. Benchmarks write compact JSON (gzipped where it
    holds per-step samples), so publishing results does not creep past it."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    paths = [REPO_ROOT / p for p in listed.decode().split("\0") if p]
    sizes = {p: p.stat().st_size for p in paths if p.is_file()}  # a deletion not yet committed is gone
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:5]
    assert total <= TRACKED_TREE_LIMIT, (
        f"tracked files hold {total / 2**20:.2f} MiB, over {TRACKED_TREE_LIMIT / 2**20:.0f} MiB; largest: "
        + ", ".join(f"{p.relative_to(REPO_ROOT)} ({sizes[p] / 2**20:.2f} MiB)" for p in largest)
    )


def test_a_checkout_finds_its_shipped_drafters() -> None:
    """From a checkout (`make serve`), the default target's drafters are the checkout's `drafters/`:
    without them the server falls back to plain decoding with only a warning."""
    from model.load.loading import DEFAULT_DFLASH_DRAFTER_DIR, DEFAULT_DRAFTER_DIR, default_drafter_path

    repo = Path(__file__).resolve().parent.parent
    assert DEFAULT_DRAFTER_DIR == repo / "drafters" / "smollm2-135m-domino"
    assert DEFAULT_DFLASH_DRAFTER_DIR == repo / "drafters" / "smollm2-135m-dflash"
    assert default_drafter_path("domino") == DEFAULT_DRAFTER_DIR
    assert default_drafter_path("dflash") == DEFAULT_DFLASH_DRAFTER_DIR
