#!/usr/bin/env bash
# Makes a local CPU base image for the Dockerfile: Debian bookworm (mmdebstrap, minbase) with Python
# 3.11, pip, and the CPU wheel of exactly the torch that constraints.txt pins. It plays the part the
# pytorch/pytorch image plays for the GPU build (an interpreter whose torch install.sh --keep-torch
# keeps), so the same Dockerfile builds a CPU image with nothing else changed:
#
#   docker/make_cpu_base.sh [TAG]          # default TAG: localhost/domino-serve-cpu-base:bookworm
#   podman build --build-arg BASE_IMAGE=localhost/domino-serve-cpu-base:bookworm -t domino-serve:cpu .
#
# Why not a registry image: none but the package registries can be reached here, and this needs only
# Debian's archive and PyPI. Runs as root (mmdebstrap's root mode); needs mmdebstrap and podman or a
# working docker (CONTAINER_ENGINE picks one).
#
# The torch wheel: TORCH_WHEEL=/path/to/torch-2.13.0+cpu-cp311-*.whl, else whatever the host's pip
# finds for `torch==2.13.0+cpu` (the same place `make install` gets it from: its find-links or extra
# index). The base is Debian 12's Python 3.11, so the wheel must be a cp311 one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TAG="${1:-localhost/domino-serve-cpu-base:bookworm}"
SUITE=bookworm
# torch needs setuptools>=77.0.3 at run time and constraints.txt does not pin it (pip freeze leaves it
# out); this is the version the project's .venv has.
SETUPTOOLS_PIN="setuptools==84.2.1"

engine() {
  if [ -n "${CONTAINER_ENGINE:-}" ]; then
    echo "$CONTAINER_ENGINE"
  elif command -v podman >/dev/null; then
    echo podman
  elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    echo docker # the CLI alone (no daemon) is not enough
  else
    echo "make_cpu_base.sh: neither podman nor a working docker found" >&2
    return 1
  fi
}
ENGINE="$(engine)"
command -v mmdebstrap >/dev/null || {
  echo "make_cpu_base.sh: mmdebstrap is missing (apt-get install mmdebstrap)" >&2
  exit 1
}

torch_version="$(grep -E '^torch==' "$ROOT/constraints.txt" | cut -d= -f3)" # 2.13.0+cpu
case "$torch_version" in
  *+cpu) ;;
  *)
    echo "make_cpu_base.sh: constraints.txt pins torch==$torch_version, not a +cpu build" >&2
    exit 1
    ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/in"

if [ -n "${TORCH_WHEEL:-}" ]; then
  cp "$TORCH_WHEEL" "$work/in/"
else
  # Ask for the base's platform explicitly: the host's Python need not be 3.11.
  python3 -m pip download -q --no-deps --only-binary=:all: --dest "$work/in" \
    --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
    "torch==$torch_version"
fi
wheel="$(cd "$work/in" && ls torch-*.whl)"
cp "$ROOT/constraints.txt" "$work/in/constraints.txt"
echo "$SETUPTOOLS_PIN" >>"$work/in/constraints.txt"
cp "${HOST_CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}" "$work/in/host-ca.crt"

# python3-pip: install.sh --keep-torch uses the base interpreter's pip (as in the pytorch image).
# passwd: the Dockerfile's useradd. ca-certificates: pip and the default-model download use HTTPS.
# The customize hooks install torch with its dependencies (at the pinned versions) into the system
# interpreter, then drop pip's and apt's caches. --break-system-packages: this interpreter is the
# image's base, nothing else on it is managed by apt after this point. force-unsafe-io: no fsync per
# file, this root filesystem is thrown away if the build fails. pip runs with a clean
# environment (the host's PIP_* settings name host paths) and trusts the host's CA bundle, which may
# hold a TLS-inspecting proxy's CA; the bundle is used for this step only, not left in the image.
# Hooks print to stderr: stdout is the tar stream.
pip_env="env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_CERT=/tmp/host-ca.crt"
mmdebstrap --variant=minbase --mode=root --format=tar --dpkgopt=force-unsafe-io \
  --include=python3,python3-pip,passwd,ca-certificates \
  --customize-hook="copy-in $work/in/$wheel $work/in/constraints.txt $work/in/host-ca.crt /tmp" \
  --customize-hook="chroot \"\$1\" $pip_env python3 -m pip install -q --no-cache-dir --break-system-packages --root-user-action=ignore --no-warn-script-location -c /tmp/constraints.txt '/tmp/$wheel' '$SETUPTOOLS_PIN' >&2" \
  --customize-hook="chroot \"\$1\" python3 -c 'import torch; print(\"base image: torch\", torch.__version__)' >&2" \
  --customize-hook="rm -f \"\$1\"/tmp/*.whl \"\$1\"/tmp/constraints.txt \"\$1\"/tmp/host-ca.crt; rm -rf \"\$1\"/var/lib/apt/lists/* \"\$1\"/root/.cache" \
  "$SUITE" - |
  # Streamed into the engine (the tarball is ~1 GB). An imported tarball has no configuration: give
  # it the PATH every Debian image has.
  "$ENGINE" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$TAG" >/dev/null || {
  "$ENGINE" rmi -f "$TAG" >/dev/null 2>&1 || true # the import of a cut stream (pipefail: mmdebstrap failed)
  exit 1
}
echo "base image: $TAG ($("$ENGINE" run --rm --network none --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 "$TAG" python3 --version 2>&1))"
