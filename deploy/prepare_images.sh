#!/usr/bin/env bash
# The two images deploy/Dockerfile builds from, made locally (no registry needed); run it once before
# `docker-compose -f deploy/docker-compose.yml build` (deploy/compose_check.sh runs it first):
#
#   BASE_IMAGE (default tiller-base:bookworm): Debian bookworm with python3 and python3-venv, from
#     `debootstrap --variant=minbase` + `docker import`; made only when missing (debootstrap needs root and
#     Debian's mirror; about 2 minutes). Any Debian/Ubuntu-like image with python3 >= 3.11 and python3-venv
#     serves instead: set BASE_IMAGE to it here and for the build.
#   tiller-pip-source: what pip on this host installs torch from (its find-links wheel directory and its
#     CA bundle; see deploy/Dockerfile), made every time (seconds; the wheels are hard links).
#
# Environment: PY (the python whose pip configuration is read, default .venv/bin/python, else python3),
# BASE_IMAGE, PIP_SOURCE_IMAGE, DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
BASE_IMAGE=${BASE_IMAGE:-tiller-base:bookworm}
PIP_SOURCE_IMAGE=${PIP_SOURCE_IMAGE:-tiller-pip-source}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

docker info >/dev/null 2>&1 || { echo "no Docker engine answers (deploy/compose_check.sh's header says how to start one)"; exit 1; }

# A folder from mktemp -d is mode 0700, and `tar -C dir .` makes that the image's `/`: every user but
# root is then refused everything (the services run as `tiller`: exec "python": executable file not found).
import_dir() {  # import_dir DIR IMAGE
  chmod 755 "$1"
  tar -C "$1" -c . | docker import - "$2" >/dev/null
}

# A base image an earlier version of this script made has that 0700 root: make it again.
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
   && ! docker run --rm --network none --user 65534 "$BASE_IMAGE" /bin/true >/dev/null 2>&1; then
  echo "base image $BASE_IMAGE: refuses to run as a user other than root (its / is not 755): made again"
  docker rmi "$BASE_IMAGE" >/dev/null
fi
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "base image $BASE_IMAGE: debootstrap --variant=minbase bookworm + docker import"
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
    "$DEBIAN_MIRROR" >/dev/null
  import_dir "$rootfs" "$BASE_IMAGE"
  rm -rf "$rootfs"
else
  echo "base image $BASE_IMAGE: present"
fi

pipdir=$(mktemp -d)
mkdir -p "$pipdir/wheels"
links=${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}
for dir in $links; do
  if [ -d "$dir" ]; then cp -l "$dir"/*.whl "$pipdir/wheels/" 2>/dev/null || cp "$dir"/*.whl "$pipdir/wheels/" || true; fi
done
cert=${PIP_CERT:-$("$PY" -m pip config get global.cert 2>/dev/null || true)}
if [ -f "$cert" ]; then cp "$cert" "$pipdir/cert.pem"; fi
echo "pip source image $PIP_SOURCE_IMAGE: wheels: $(ls "$pipdir/wheels" | tr '\n' ' ') CA bundle: ${cert:-none}"
import_dir "$pipdir" "$PIP_SOURCE_IMAGE"
rm -rf "$pipdir"
