#!/usr/bin/env bash
# The container stack, end to end: build the image, start deploy/docker-compose.yml, send a WebSocket, an
# OpenAI and a gRPC request (deploy/smoke.py), kill one container, check that it comes back and the three
# surfaces answer again, tear everything down. Slow (a full image build: ~20 min on dockerd's vfs storage
# driver, a few minutes on overlayfs), so it is not part of `make test`.
#
# Needs a Docker engine, docker-compose (Debian's 1.29 or the `docker compose` plugin) and this checkout's
# .venv for the clients (`make install`). A local engine on a machine without one (Debian, as root):
#
#   apt-get install -y docker.io docker-compose debootstrap
#   dockerd --iptables=false --storage-driver=vfs >/tmp/dockerd.log 2>&1 &
#
# (--iptables=false and vfs: machines where the engine may not change the firewall or mount overlays.
# Builds then use the host's network; containers talk over the compose network, the host reaches them
# through published ports.) Without a registry the base image is made from Debian with debootstrap
# (deploy/prepare_images.sh, which this script runs first).
#
# Environment: KILL (the service killed, default worker), TILLER_HTTP_PORT_HOST / TILLER_GRPC_PORT_HOST
# (default: free ports), PY (python with the clients, default .venv/bin/python), BASE_IMAGE (default
# tiller-base:bookworm, built when missing), KEEP=1 (leave the stack up), HEALTH_TIMEOUT_S (default 900).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
KILL=${KILL:-worker}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-900}
export BASE_IMAGE=${BASE_IMAGE:-tiller-base:bookworm}
export PIP_SOURCE_IMAGE=tiller-pip-source
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-tillercheck}
# Creating a container copies the whole image on vfs: minutes each, past docker-compose's 60 s API timeout.
# (COMPOSE_PARALLEL_LIMIT=2 made docker-compose 1.29 hang here without calling the engine.)
export COMPOSE_HTTP_TIMEOUT=${COMPOSE_HTTP_TIMEOUT:-1200}
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export TILLER_HTTP_PORT_HOST=${TILLER_HTTP_PORT_HOST:-$(free_port)}
export TILLER_GRPC_PORT_HOST=${TILLER_GRPC_PORT_HOST:-$(free_port)}

if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
compose+=(-f deploy/docker-compose.yml)
step() { printf '\n== %s  [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }

docker info >/dev/null 2>&1 || { echo "no Docker engine answers (see the top of $0 to start one)"; exit 1; }
[ -x "$PY" ] || { echo "$PY not found: run \`make install\` first (the clients run from the venv)"; exit 1; }

step "compose file"
"${compose[@]}" config -q && echo "valid"

step "base and pip-source images (deploy/prepare_images.sh)"
PY="$PY" deploy/prepare_images.sh

teardown() {
  if [ "${KEEP:-0}" = 1 ]; then echo "KEEP=1: the stack stays up (${compose[*]} down -v)"; return; fi
  step "tear down"
  "${compose[@]}" down -v --remove-orphans
}
trap teardown EXIT

step "build"
time "${compose[@]}" build

step "up (host ports: http $TILLER_HTTP_PORT_HOST, grpc $TILLER_GRPC_PORT_HOST)"
"${compose[@]}" up -d

wait_healthy() {
  local deadline=$((SECONDS + HEALTH_TIMEOUT_S)) last="" now
  while :; do
    now=$(for id in $("${compose[@]}" ps -q); do
      docker inspect -f '{{.Name}}={{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$id"
    done | sed 's#^/##' | sort | tr '\n' ' ')
    [ "$now" != "$last" ] && echo "  $now" && last=$now
    if ! grep -qv '=healthy' <<<"$(tr ' ' '\n' <<<"$now" | sed '/^$/d')"; then return 0; fi
    if [ $SECONDS -ge $deadline ]; then
      echo "not healthy after ${HEALTH_TIMEOUT_S}s"; "${compose[@]}" logs --tail=40; return 1
    fi
    sleep 5
  done
}

step "wait until every container is healthy"
time wait_healthy

smoke() {  # the clients import this checkout's common/ (protobuf stubs)
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" deploy/smoke.py \
    --http-port "$TILLER_HTTP_PORT_HOST" --grpc-port "$TILLER_GRPC_PORT_HOST"
}
step "three surfaces"
smoke

# `docker kill` counts as a manual stop, which restart policies never undo: kill the container's process
# from the host instead, as a crash would, and restart: unless-stopped brings it back
step "kill the $KILL container's process (SIGKILL from the host, as a crash)"
victim=$("${compose[@]}" ps -q "$KILL")
before=$(docker inspect -f '{{.RestartCount}} {{.State.StartedAt}}' "$victim")
kill -9 "$(docker inspect -f '{{.State.Pid}}' "$victim")"
sleep 2
after=$(docker inspect -f '{{.RestartCount}} {{.State.StartedAt}}' "$victim")
echo "restart count and start time: before $before, after $after"
[ "$before" != "$after" ] || { echo "the $KILL container was not restarted"; exit 1; }

step "wait until healthy again"
time wait_healthy

step "three surfaces after the recovery"
smoke

step "PASS"
