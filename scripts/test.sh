#!/usr/bin/env bash
# Every test kiln has: Rust unit and integration tests (real runsc, real mmdebstrap, real KVM
# where usable), then the SDK end-to-end tests with the real `e2b` Python SDK. CI runs this.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$KILN_ROOT"
need_cargo
# One build per run: incremental caches would only take disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The build directory lives in kiln's cache (unless CARGO_TARGET_DIR says otherwise), so a run
# from a fresh checkout, as CI's is, compiles only kiln's own crates: cargo reuses the
# dependencies a run before compiled (it keys them by version, features, flags and toolchain).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$KILN_CACHE/target}"
# The build, the templates and the sandboxes share one disk; say what the run starts with.
say "disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free where kiln builds"

say "host packages"
install_packages cc:gcc mmdebstrap:mmdebstrap mkfs.ext4:e2fsprogs debugfs:e2fsprogs \
  nft:nftables ip:iproute2 python3:python3 unshare:util-linux tmux:tmux
python3 -c 'import venv, ensurepip' 2>/dev/null || install_packages python3-venv-missing:python3-venv
# The code interpreter's tests run Debian's IPython kernel and Node.js on the host.
/usr/bin/python3 -c 'import ipykernel, matplotlib, pandas, PIL' 2>/dev/null ||
  install_packages ipykernel-missing:python3-ipykernel matplotlib-missing:python3-matplotlib \
    pandas-missing:python3-pandas pil-missing:python3-pil munkres-missing:python3-munkres
# The JavaScript SDK suite and the console's bundle check install their npm packages (npm ci).
install_packages node:nodejs npm:npm
# The image tests run Debian's registry (CNCF distribution) on loopback and push with skopeo.
install_packages docker-registry:docker-registry skopeo:skopeo htpasswd:apache2-utils openssl:openssl
# The desktop tests render the noVNC stream in the host's Chromium (through Playwright).
install_packages chromium:chromium
# kiln-cluster: etcd-client's build compiles etcd's .proto files (need_protoc); its tests start
# their own 3-member etcd clusters on loopback from Debian's etcd-server (no system etcd).
need_protoc
install_packages etcd:etcd-server
stop_system_etcd

say "formatting and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
scripts/check-deps.sh
python3 scripts/check-circles.py --self-test
python3 scripts/check-circles.py

say "building the workspace"
cargo build --workspace --all-targets
build_static_agent

export KILN_BIN="$CARGO_TARGET_DIR/debug/kiln"
export KILN_AGENT_BIN="$STATIC_AGENT"

# Every test below runs kiln's pinned runsc (not Debian bookworm's 2022 one).
ensure_runsc "$KILN_BIN"

say "templates (cached by hash: a rebuild only when a recipe or the agent changed)"
"$KILN_BIN" template build base
"$KILN_BIN" template build code-interpreter-v1
# devtools (gcc, make, npm, ssh; about 5 min cold): the rules' false-positive suite.
"$KILN_BIN" template build devtools
# The desktop and browser templates (each about 6-8 min cold, mostly downloads and dpkg) build
# side by side; a cache hit takes a second.
"$KILN_BIN" template build desktop > "$CARGO_TARGET_DIR/template-desktop.log" 2>&1 & desktop_pid=$!
"$KILN_BIN" template build browser > "$CARGO_TARGET_DIR/template-browser.log" 2>&1 & browser_pid=$!
for t in desktop browser; do
  pid_var="${t}_pid"
  if ! wait "${!pid_var}"; then
    cat "$CARGO_TARGET_DIR/template-$t.log"
    die "building the $t template failed"
  fi
  tail -n 3 "$CARGO_TARGET_DIR/template-$t.log"
done

say "python venv for SDK tests"
# It also holds moto[server], the S3 server kiln-cluster's object-storage tests start on loopback
# (through KILN_PYTHON, exported before the rust tests).
req_hash=$( (cat tests/sdk/requirements.txt; python3 --version) | sha256sum | cut -c1-16)
venv="$KILN_CACHE/venv-$req_hash"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r tests/sdk/requirements.txt
  touch "$venv/.complete"
fi
export KILN_PYTHON="$venv/bin/python"

say "rust tests"
cargo test --workspace --no-fail-fast

say "SDK end-to-end tests"
set +e
# The slowest tests are listed, so that a suite growing past its time budget shows where.
"$KILN_PYTHON" -m pytest tests/sdk -q -rs --durations=20
rc=$?
say "JavaScript SDK tests (the pinned e2b npm package under node --test)"
# node_modules is cached by the lockfile's hash (like the venv) and linked into tests/js.
js_hash=$( (cat tests/js/package-lock.json; node --version) | sha256sum | cut -c1-16)
js_deps="$KILN_CACHE/node-$js_hash"
if [ ! -f "$js_deps/.complete" ]; then
  rm -rf "$js_deps"
  mkdir -p "$js_deps"
  cp tests/js/package.json tests/js/package-lock.json "$js_deps/"
  (cd "$js_deps" && npm ci --no-audit --no-fund --loglevel=error) && touch "$js_deps/.complete"
fi
[ -L tests/js/node_modules ] || rm -rf tests/js/node_modules
ln -sfn "$js_deps/node_modules" tests/js/node_modules
node tests/js/run.mjs
rc_js=$?
[ $rc -eq 0 ] && rc=$rc_js
say "abuse tests (hostile workloads against kiln serve)"
"$KILN_PYTHON" -m pytest tests/abuse -q -rs
rc_abuse=$?
[ $rc -eq 0 ] && rc=$rc_abuse
say "fuzzing (each cargo-fuzz target briefly; longer by hand: scripts/fuzz.sh 600)"
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
cargo +nightly fuzz --version >/dev/null 2>&1 || cargo install --locked cargo-fuzz
# (The fuzz crate is a workspace of its own, built by nightly with sanitizers: its own directory.)
CARGO_TARGET_DIR="$KILN_CACHE/fuzz-target" scripts/fuzz.sh 15
rc_fuzz=$?
[ $rc -eq 0 ] && rc=$rc_fuzz
set -e
if [ $rc -eq 5 ]; then
  die "pytest collected no SDK tests"
fi
exit $rc
