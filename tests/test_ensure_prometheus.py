"""scripts/ensure_prometheus.sh stops only the Prometheus its package install started, never one the
user already runs (before: `pkill -x prometheus` stopped every process of that name).

The package manager is replaced by stubs on PATH: `apt-get install` "installs" prometheus and
promtool and starts a daemon named prometheus, as the Debian package's service would."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

from tests.fixtures import REPO_ROOT
from tests.fixtures.waiting import wait_for

SCRIPT = REPO_ROOT / "scripts" / "ensure_prometheus.sh"


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of ours lingers as a zombie until reaped.
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_only_the_prometheus_the_install_started_is_stopped(tmp_path: Path) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    stubs, installed, user = tmp_path / "stubs", tmp_path / "installed", tmp_path / "user"
    for d in (stubs, installed, user):
        d.mkdir()
    # The user's own Prometheus: a process named `prometheus`, not on PATH (so not "installed").
    shutil.copy(sleep, user / "prometheus")
    users = subprocess.Popen([str(user / "prometheus"), "300"])
    service_pid = tmp_path / "service.pid"
    _stub(
        stubs / "apt-get",
        f"""[ "$1" = install ] || exit 0
cp {sleep} {installed}/prometheus && cp {sleep} {installed}/promtool
setsid {installed}/prometheus 300 </dev/null >/dev/null 2>&1 &
echo $! > {service_pid}
""",
    )
    for name in ("systemctl", "service"):  # no service manager: the processes are all there is
        _stub(stubs / name, "exit 1\n")
    _stub(stubs / "sudo", 'exec "$@"\n')
    # A machine that has Prometheus already (`make test` installs it) must not short-cut the script.
    # Dropping the directories that hold promtool would drop /usr/bin (and bash, cp, kill) with them:
    # link every other system tool into one directory instead.
    system = tmp_path / "system"
    system.mkdir()
    for directory in filter(None, os.environ["PATH"].split(":")):
        for tool in Path(directory).glob("*") if Path(directory).is_dir() else ():
            link = system / tool.name
            if tool.name not in ("prometheus", "promtool") and not link.exists() and os.access(tool, os.X_OK):
                link.symlink_to(tool.resolve())
    env = {**os.environ, "PATH": ":".join([str(stubs), str(installed), str(system)])}
    try:
        result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        started = int(service_pid.read_text())
        # The script sends it SIGTERM and returns: the process is gone a moment later.
        wait_for(
            lambda: _alive(started),
            until=lambda alive: not alive,
            timeout=10,
            what="the Prometheus the install started to stop",
        )
        assert users.poll() is None, "the user's own Prometheus was stopped"
    finally:
        users.kill()
        users.wait()
        if service_pid.exists() and _alive(int(service_pid.read_text())):
            os.kill(int(service_pid.read_text()), 9)  # the stub's daemon, started by this test
