# Shared by scripts/serve.sh and scripts/test.sh: host preparation and builds.
# shellcheck shell=bash

KILN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOST_TRIPLE=x86_64-unknown-linux-gnu
# kiln's cache on this host: the test command's venv, npm packages and build directory.
KILN_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kiln"

# Cargo's build directory: CARGO_TARGET_DIR when set, else the repository's target/.
target_dir() { echo "${CARGO_TARGET_DIR:-$KILN_ROOT/target}"; }

# Each step says how long the script has run (bash's SECONDS), so a slow step shows in a log.
say() { printf '\033[1m==> (%d:%02d) %s\033[0m\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

need_cargo() {
  if ! command -v cargo >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
  fi
  command -v cargo >/dev/null 2>&1 || die "cargo (Rust stable) is required: install it with rustup, then run this again"
}

# install_packages CMD:PKG ... — installs the packages whose command is missing (apt, as root).
install_packages() {
  local missing=() pair cmd pkg
  for pair in "$@"; do
    cmd=${pair%%:*}; pkg=${pair#*:}
    if ! command -v "$cmd" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$cmd" ] && [ ! -x "/sbin/$cmd" ]; then
      missing+=("$pkg")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing host packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
  else
    die "missing host packages: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}"
  fi
}

# need_protoc — the kiln binary links kiln-cluster, whose etcd-client dependency compiles etcd's
# .proto files at build time: protoc, and the well-known types it imports
# (google/protobuf/descriptor.proto, struct.proto), which Debian ships in libprotobuf-dev (only
# a recommendation of protobuf-compiler, and packages are installed without those).
need_protoc() {
  install_packages protoc:protobuf-compiler
  if [ ! -f /usr/include/google/protobuf/descriptor.proto ]; then
    install_packages protobuf-dev-missing:libprotobuf-dev
  fi
}

# stop_system_etcd — the etcd-server package starts a system etcd on port 2379 where an init
# system runs one; kiln's tests start their own members on free ports and need none.
stop_system_etcd() {
  if command -v systemctl >/dev/null 2>&1 && systemctl is-enabled --quiet etcd 2>/dev/null; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
  if [ -x /etc/init.d/etcd ] && [ -f /run/etcd.pid ]; then  # started by the sysv script
    /etc/init.d/etcd stop >/dev/null 2>&1 || true
  fi
}

# The agent runs inside root filesystems whose libc kiln does not control: build it static.
build_static_agent() {
  local profile_flag=(--release)
  say "building kiln-agent (static)"
  # Stripped: the binary is copied into every template.
  (cd "$KILN_ROOT" && RUSTFLAGS="-C target-feature=+crt-static" CARGO_PROFILE_RELEASE_STRIP=debuginfo \
    cargo build "${profile_flag[@]}" -p kiln-agent --bin kiln-agent --target "$HOST_TRIPLE")
  STATIC_AGENT="$(target_dir)/$HOST_TRIPLE/release/kiln-agent"
  [ -x "$STATIC_AGENT" ] || die "static agent not found at $STATIC_AGENT after the build"
}

# ensure_runsc KILN — the runsc kiln pins (bookworm-backports 0.0~20240729 or newer): `kiln runtime
# ensure` finds it in kiln's cache or downloads it with apt's own machinery and a private apt
# state (the host's apt setup is not changed). Exports KILN_RUNSC (read by `kiln serve`, the
# tests and the benches) and puts its directory first on PATH, so everything that looks up
# `runsc` (the server tests, the SDK tests' `kiln serve`) runs this one.
ensure_runsc() {
  local kiln=$1 path
  say "runsc (gVisor runtime)"
  path=$("$kiln" runtime ensure) || die "could not obtain runsc (see above); \`$kiln runtime ensure\` is the command to retry"
  [ -x "$path" ] || die "kiln runtime ensure printed $path, which is not executable"
  export KILN_RUNSC="$path"
  PATH="$(dirname "$path"):$PATH"
  export PATH
  "$path" --version | sed -n 1p >&2  # sed reads it all: no SIGPIPE under pipefail
  # The platform `kiln serve` would pick (fastest that works); the driver tests use it too.
  KILN_PLATFORM=${KILN_PLATFORM:-$("$kiln" runtime platform)} || die "no gVisor platform works with $path"
  export KILN_PLATFORM
  say "gVisor platform: $KILN_PLATFORM"
}
