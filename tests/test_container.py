"""The Docker image, checked without a Docker engine (`make test-container`, docker/smoke.sh, builds
and runs the real image; it needs podman and the network, so it is not part of `make test`).

- The Dockerfile's contract (a base image argument defaulting to the pinned CUDA torch image, non-root
  user, HEALTHCHECK, 0.0.0.0, layer order, no secrets), read from the file itself, and that the CPU
  build of docker/smoke.sh differs from it only in the base.
- Its install and start steps run here outside Docker: `docker/install.sh --keep-torch all` into a
  fresh venv whose "base image" packages (torch and the rest) are the project's .venv, offline, so a
  pin the base does not satisfy fails instead of downloading; then `docker/entrypoint.sh` from that
  venv serves a Qwen3 target and a Domino drafter given as Hugging Face ids of a local HF cache, and
  the embedded default on the CPU when no target is given.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.fixtures import REPO_ROOT
from tests.fixtures.servers import ServerProcess, free_port

DOCKERFILE = REPO_ROOT / "Dockerfile"
INSTALL = REPO_ROOT / "docker" / "install.sh"
ENTRYPOINT = REPO_ROOT / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO_ROOT / "docker" / "healthcheck.py"
SMOKE = REPO_ROOT / "docker" / "smoke.sh"
CPU_BASE = REPO_ROOT / "docker" / "make_cpu_base.sh"


# -- the Dockerfile --------------------------------------------------------------------------------


@dataclass
class Instruction:
    op: str  # upper case: FROM, RUN, COPY, ...
    args: str


def dockerfile() -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (as Docker reads them)."""
    out: list[Instruction] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        op, _, args = (pending + line).partition(" ")
        out.append(Instruction(op.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "dangling line continuation"
    return out


def env_pairs(instructions: list[Instruction]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for ins in instructions:
        if ins.op == "ENV":
            for item in shlex.split(ins.args):
                key, _, value = item.partition("=")
                pairs[key] = value
    return pairs


def index_of(instructions: list[Instruction], op: str, pattern: str) -> int:
    hits = [i for i, ins in enumerate(instructions) if ins.op == op and re.search(pattern, ins.args)]
    assert len(hits) == 1, f"expected one {op} matching {pattern!r}, found {len(hits)}"
    return hits[0]


def constraints_lines() -> list[str]:
    return [x.strip() for x in (REPO_ROOT / "constraints.txt").read_text().splitlines()]


def pinned(name: str) -> str:
    line = next(x for x in (REPO_ROOT / "requirements.txt").read_text().splitlines() if x.startswith(f"{name}=="))
    return line.split("==", 1)[1]


def test_base_image_is_a_build_argument_defaulting_to_the_cuda_build_of_the_pinned_torch() -> None:
    ins = dockerfile()
    froms = [i for i, x in enumerate(ins) if x.op == "FROM"]
    assert len(froms) == 1 and ins[froms[0]].args == "${BASE_IMAGE}"
    # Declared before FROM (only such an ARG can be used in it), with the GPU image as its default.
    (arg,) = [x.args for x in ins[: froms[0]] if x.op == "ARG"]
    name, _, default = arg.partition("=")
    assert name == "BASE_IMAGE"
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", default)
    assert match, f"default base image not pinned to an exact CUDA runtime tag: {default}"
    # install.sh --keep-torch keeps the base image's torch: it must be the release CI tests with.
    assert match.group(1) == pinned("torch")


def test_the_cpu_build_differs_only_in_its_base() -> None:
    """docker/smoke.sh builds this same Dockerfile, on the base docker/make_cpu_base.sh makes, and the
    one thing it passes that changes the image is BASE_IMAGE."""
    smoke = SMOKE.read_text()
    assert re.findall(r"--build-arg\s+(\S+)", smoke) == ['"BASE_IMAGE=$BASE_IMAGE"']
    build_lines = [x for x in smoke.splitlines() if "BUILD_ARGS" in x]  # no other Dockerfile:
    assert len(build_lines) >= 2 and not any(re.search(r"\s(-f|--file)[\s=]", x) for x in build_lines)
    assert re.search(r'^\s*nice -n 10 "\$ENGINE" build "\$\{BUILD_ARGS\[@\]\}" "\$ROOT"', smoke, re.M)
    assert "make_cpu_base.sh" in smoke
    # Whatever it creates goes, also on failure.
    assert re.search(r"^trap cleanup EXIT$", smoke, re.M)
    # The CPU base installs exactly the pinned torch build: the version is read from constraints.txt.
    base = CPU_BASE.read_text()
    assert "grep -E '^torch==' \"$ROOT/constraints.txt\"" in base
    assert pinned("torch") and any(x == f"torch=={pinned('torch')}+cpu" for x in constraints_lines())
    recipe = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^test-container:.*\n\tbash docker/smoke\.sh$", recipe, re.M)
    for script in (SMOKE, CPU_BASE):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr


def model_imports(module: Path) -> set[str]:
    """The model.* modules a module of model/ imports (anywhere in it), followed through each other."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("model.") and name not in seen:
                    seen.add(name)
                    todo.append(REPO_ROOT / (name.replace(".", "/") + ".py"))
    return seen


def test_the_default_model_layer_copies_every_module_it_imports() -> None:
    ins = dockerfile()
    step = index_of(ins, "RUN", r"docker/install\.sh default-model /opt/venv\b")
    # Where each file lands (COPY a/b.py c/d.py dest/ puts both in dest/): a module copied to the
    # wrong folder is not found either.
    landed = set()
    for x in ins[:step]:
        if x.op == "COPY":
            *sources, dest = x.args.split()
            landed |= {dest.rstrip("/") + "/" + Path(s).name for s in sources}
    modules = {"model.load.default_model"} | model_imports(REPO_ROOT / "model" / "load" / "default_model.py")
    needed = {m.replace(".", "/") + ".py" for m in modules}
    needed |= {str(Path(p).parent / "__init__.py") for p in needed}  # every package on the way
    needed |= {str(Path(p).parent.parent / "__init__.py") for p in needed if Path(p).parent.parent != Path(".")}
    assert needed <= landed, f"the default-model step would not find {sorted(needed - landed)}"


def test_runtime_contract() -> None:
    ins = dockerfile()
    env = env_pairs(ins)
    assert env["DOMINO_HOST"] == "0.0.0.0"  # reachable through the published port
    assert [i.args for i in ins if i.op == "EXPOSE"] == [env["DOMINO_PORT"]]
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"]  # ids resolve from the mounted cache only
    assert env["PATH"].startswith(f"{env['VIRTUAL_ENV']}/bin:")

    # Non-root from the last USER on, and nothing runs as root after it.
    users = [i for i, x in enumerate(ins) if x.op == "USER"]
    assert users, "the image would run as root"
    last_user = ins[users[-1]].args.split(":")[0]
    assert last_user not in ("root", "0")
    assert all(x.op != "RUN" for x in ins[users[-1] :])

    health = [x.args for x in ins if x.op == "HEALTHCHECK"]
    assert len(health) == 1 and "--start-period=" in health[0]
    assert "docker/healthcheck.py" in health[0]  # which asks /health (tested below)

    entry = [json.loads(x.args) for x in ins if x.op == "ENTRYPOINT"]
    assert entry == [["/app/docker/entrypoint.sh"]]  # exec form: the server gets docker stop's SIGTERM
    workdir = [x.args for x in ins if x.op == "WORKDIR"]
    assert workdir == ["/app"]


def test_layers_are_ordered_for_caching_and_use_the_ci_install_script() -> None:
    ins = dockerfile()
    copy_pins = index_of(ins, "COPY", r"^requirements\.txt constraints\.txt ")
    deps = index_of(ins, "RUN", r"docker/install\.sh --keep-torch deps /opt/venv$")
    default_model = index_of(ins, "RUN", r"docker/install\.sh default-model /opt/venv\b")
    copy_src = index_of(ins, "COPY", r"^\. \.$")
    project = index_of(ins, "RUN", r"docker/install\.sh project /opt/venv$")
    assert copy_pins < deps < default_model < copy_src < project
    # Before the dependencies are installed, only the pins and the install script are in the image.
    early = [x.args for x in ins[:deps] if x.op in ("COPY", "ADD")]
    assert early == ["requirements.txt constraints.txt ./", "docker/install.sh docker/"]
    # Every install goes through docker/install.sh, the script `make install` (so CI) runs too.
    assert not any(re.search(r"\bpip3? install\b", x.args) for x in ins if x.op == "RUN")
    recipe = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^\tbash docker/install\.sh all \$\(VENV\)$", recipe, re.M)
    script = INSTALL.read_text()
    assert '-r "$ROOT/requirements.txt" -c "$ROOT/constraints.txt"' in script
    assert '"$ROOT/requirements.txt" >"$pins/requirements.txt"' in script


def test_no_secrets_in_the_image() -> None:
    ins = dockerfile()
    # Words of a variable name (HF_TOKEN, DOMINO_API_KEY), not substrings (TOKENIZERS_PARALLELISM).
    secret_words = {"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "AUTH"}
    for x in ins:
        if x.op in ("ENV", "ARG", "LABEL"):
            for item in shlex.split(x.args):
                name, _, value = item.partition("=")
                secretish = secret_words & set(re.split(r"[_\W]+", name.upper()))
                assert not (secretish and value), f"{x.op} {item} bakes a secret into the image"
        if x.op in ("COPY", "ADD"):
            assert not re.search(r"\.env\b|\.netrc|\.pem|id_rsa|token", x.args), x.args
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    ignored = {x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#")}
    assert {".git", ".venv", ".env", ".env.*"} <= ignored
    assert "drafters" not in ignored and "drafters/" not in ignored  # shipped drafters go into the image


# -- the same steps outside Docker -----------------------------------------------------------------


def base_image_env(tmp: Path) -> dict[str, str]:
    """The environment the image's steps see, emulated: the base interpreter's packages are .venv's
    site-packages (as torch is the base image's), pip works offline, and servers stay on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DOMINO_", "PIP_", "HF_", "VIRTUAL_ENV"))}
    env.update(
        PYTHON=getattr(sys, "_base_executable", sys.executable),
        PYTHONPATH=sysconfig.get_paths()["purelib"],
        PIP_NO_INDEX="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        DOMINO_HOST="127.0.0.1",
        DOMINO_CACHE_DIR=str(tmp / "domino-cache"),
        HF_HOME=str(tmp / "hf"),
        HF_HUB_OFFLINE="1",
    )
    return env


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv built by the image's install steps (deps + project), outside Docker."""
    root = tmp_path_factory.mktemp("image")
    venv = root / "venv"
    env = base_image_env(root)
    proc = subprocess.run(
        ["bash", str(INSTALL), "--keep-torch", "all", str(venv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "from the base image" in proc.stdout  # torch was kept, not reinstalled
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    assert (venv / "bin" / "domino-serve").exists()
    # Every pin was already satisfied by the "base image" (the tested .venv): only the project itself
    # went into the venv, so the image installs exactly the versions CI tests.
    site = next((venv / "lib").glob("python3*/site-packages"))
    installed = [p.name for p in site.glob("*.dist-info")]
    assert len(installed) == 1 and installed[0].startswith("domino_serve-"), installed
    return venv


def hf_cache_entry(hf_home: Path, repo_id: str, files: Path) -> None:
    """Lay a directory out as the hub cache does (`hf download` on the host leaves this shape)."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in files.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def start_entrypoint(venv: Path, env: dict[str, str], log: Path, *args: str) -> ServerProcess:
    """docker/entrypoint.sh with the image venv first on PATH (as the image's ENV PATH has it)."""
    env = {**env, "PATH": f"{venv / 'bin'}:{env['PATH']}"}
    return ServerProcess(log, command=["bash", str(ENTRYPOINT), *args], env=env)


def healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture
def stopping() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    for srv in servers:
        srv.stop()


def test_entrypoint_serves_hub_ids_from_the_mounted_cache(
    image_venv: Path,
    tiny_target_dir: Path,
    tiny_drafter_dir: Path,
    tmp_path: Path,
    stopping: list[ServerProcess],
) -> None:
    env = base_image_env(tmp_path)
    hf_cache_entry(Path(env["HF_HOME"]), "test-org/tiny-qwen3", tiny_target_dir)
    hf_cache_entry(Path(env["HF_HOME"]), "test-org/tiny-domino", tiny_drafter_dir)
    env.update(DOMINO_TARGET="test-org/tiny-qwen3", DOMINO_DRAFTER="test-org/tiny-domino", DOMINO_DRAIN_TIMEOUT="5")
    env["DOMINO_DRAFT_POLICY"] = "fixed"  # every step verifies drafts: the check below cannot depend on the policy
    srv = start_entrypoint(image_venv, env, tmp_path / "server.log", "--max-model-len", "256")
    stopping.append(srv)
    srv.wait_ready()

    # exec: the process docker would signal is domino-serve itself, from the image's venv.
    cmdline = Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert str(image_venv / "bin" / "domino-serve").encode() in cmdline

    with srv.client() as c:
        (card,) = c.get("/v1/models").json()["data"]
        assert card["id"] == "tiny-qwen3"  # the id's name, not the snapshot's commit hash
        assert card["max_model_len"] == 256  # `docker run IMAGE --max-model-len 256` reaches the server
        body = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 12, "temperature": 0}).json()
    assert body["model"] == "tiny-qwen3" and body["usage"]["completion_tokens"] >= 1
    # The drafter id was resolved and loaded: draft tokens were verified (`ar` counts verify steps too).
    assert body["spec_decode"]["num_draft_tokens"] > 0

    # The HEALTHCHECK command, as the container runs it (DOMINO_HOST=0.0.0.0 means "ask loopback").
    check_env = {**env, "DOMINO_HOST": "0.0.0.0", "DOMINO_PORT": str(srv.port)}
    assert healthcheck(check_env).returncode == 0
    assert healthcheck({**check_env, "DOMINO_PORT": str(free_port())}).returncode == 1

    srv.proc.send_signal(signal.SIGTERM)  # docker stop
    assert srv.proc.wait(30) == 0, srv.logs()


def test_entrypoint_fails_fast_on_a_model_missing_from_the_cache(image_venv: Path, tmp_path: Path) -> None:
    env = base_image_env(tmp_path)
    env.update(PATH=f"{image_venv / 'bin'}:{env['PATH']}", DOMINO_DRAFTER="test-org/not-downloaded")
    proc = subprocess.run(["bash", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "'test-org/not-downloaded' is neither a directory nor a model in the Hugging Face cache" in proc.stderr


@pytest.mark.slow
def test_without_a_target_the_image_serves_the_embedded_default_on_the_cpu(
    image_venv: Path, converted: Path, tmp_path: Path, stopping: list[ServerProcess]
) -> None:
    # The image converts it as root and serves it as another user: every file must be world-readable.
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in [converted, *converted.iterdir()])
    env = base_image_env(tmp_path)
    env["DOMINO_CACHE_DIR"] = str(converted.parent)  # the image's DOMINO_CACHE_DIR holds it likewise
    # The image's build step for it: here it finds the converted model and only verifies it.
    proc = subprocess.run(
        ["bash", str(INSTALL), "default-model", str(image_venv)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith(converted.name), proc.stderr[-3000:]

    srv = start_entrypoint(image_venv, env, tmp_path / "server.log")
    stopping.append(srv)
    srv.wait_ready(180)
    with srv.client() as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["SmolLM2-135M-Instruct"]
        body = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert body.status_code == 200 and body.json()["usage"]["completion_tokens"] >= 1
    assert re.search(r"loading target 'default' .* on cpu", srv.logs())
    httpx.get(srv.url + "/health").raise_for_status()
