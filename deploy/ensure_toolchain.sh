#!/usr/bin/env bash
# The tests that compile Wasm controllers need clang and wasm-ld (Debian/Ubuntu: clang + lld).
# `make test` calls this first: when they are missing and this machine can install them (apt-get, as
# root or with passwordless sudo) it installs them; when it cannot, or TILLER_INSTALL_TOOLCHAIN=no, it
# says so and exits 0 -- those tests then skip with the reason, the rest of the suite runs.
set -u
have() { command -v "$1" >/dev/null 2>&1; }
present() { { have clang || have clang-14; } && { have wasm-ld || have wasm-ld-14; }; }

present && exit 0
skip_note="the tests that compile Wasm controllers will skip (the committed .wasm files are used everywhere else)"
if [ "${TILLER_INSTALL_TOOLCHAIN:-auto}" = no ]; then
  echo "clang/wasm-ld missing and TILLER_INSTALL_TOOLCHAIN=no: $skip_note"
  exit 0
fi
if ! have apt-get; then
  echo "clang/wasm-ld missing and no apt-get here: $skip_note (install clang and lld to run them)"
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  sudo=()
elif have sudo && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "clang/wasm-ld missing and not root (no passwordless sudo): $skip_note (apt-get install clang lld)"
  exit 0
fi
echo "installing clang and lld (wasm32 toolchain for the controller tests) ..."
if "${sudo[@]}" apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q clang lld >/dev/null \
   && present; then
  echo "installed: $(clang --version 2>/dev/null | head -n 1)"
else
  echo "could not install clang/lld: $skip_note"
fi
exit 0
