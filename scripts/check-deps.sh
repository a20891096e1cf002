#!/usr/bin/env bash
# Which way the arrows point (docs/architecture.md): fails when a dependency goes the wrong way.
# - kiln-server does not depend on kiln-gvisor (the binary wires the driver; kiln-server's tests
#   may use it as a dev-dependency);
# - no gVisor/runsc names in crates/server/src and crates/cli/src outside the allowed files;
# - rusqlite only under crates/server/src/store/;
# - kiln-server does not depend on kiln-cluster (the etcd store), which keeps no SQLite;
# - the server's front (api, proxy, console, template builds) reaches sandboxes through the
#   `SandboxService` trait, never the concrete `Manager`.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
bad() { echo "check-deps: $*" >&2; fail=1; }

# Normal dependencies only (`cargo tree -e normal`), one crate per line.
server_deps=$(cargo tree --offline -q -p kiln-server -e normal --prefix none) || bad "cargo tree -p kiln-server failed"
driver_deps=$(cargo tree --offline -q -p kiln-driver -e normal --prefix none) || bad "cargo tree -p kiln-driver failed"
if grep -q '^kiln-gvisor ' <<<"$server_deps"; then
  bad "kiln-server depends on kiln-gvisor (build the driver in crates/cli and hand it to the server)"
fi
if grep -qE '^kiln-(server|gvisor|microvm) ' <<<"$driver_deps"; then
  bad "kiln-driver depends on a driver or on the server"
fi
# kiln-cluster implements the server's store seam on etcd: the arrow goes cluster -> server.
if grep -q '^kiln-cluster ' <<<"$server_deps"; then
  bad "kiln-server depends on kiln-cluster (the binary wires the etcd store into the server)"
fi

# gVisor names may appear in the doctor, `kiln runtime`, and the binary's wiring (`kiln serve`,
# its network flags in serve_net.rs, crates/cli/src/drivers.rs, which also builds the benches' runtime and raw baseline) only.
allowed_gvisor='^crates/cli/src/(doctor|runtime|serve|serve_net|drivers|main)\.rs:'
# Test data naming the driver or a driver's host path is the one exception.
known_gvisor='^crates/server/src/api/error\.rs:.*state/gvisor/sandboxes|^crates/server/src/store/sqlite_tests\.rs:.*gvisor'
hits=$(grep -rniE 'gvisor|runsc' crates/server/src crates/cli/src --include='*.rs' | grep -vE "$allowed_gvisor" | grep -vE "$known_gvisor" || true)
[ -z "$hits" ] || bad "gVisor names outside the allowed files:
$hits"

# rusqlite belongs to the state store: every other module reaches the database through the
# store's traits and handles.
hits=$(grep -rn 'rusqlite' crates/server/src --include='*.rs' | grep -v '^crates/server/src/store/' || true)
[ -z "$hits" ] || bad "rusqlite outside crates/server/src/store/:
$hits"

hits=$(grep -rn 'rusqlite' crates/cluster/src --include='*.rs' || true)
[ -z "$hits" ] || bad "rusqlite in the etcd store (crates/cluster/src):
$hits"

# The front names the lifecycle only by its trait; `AppState::new` (api/mod.rs) is where one
# host's Manager is handed in.
hits=$(grep -rnwE 'Manager' crates/server/src/{api,proxy,console,tplbuild} --include='*.rs' \
  | grep -vE '^\S+:[0-9]+:\s*//' \
  | grep -vE '^crates/server/src/api/mod\.rs:.*(use crate::manager::\{Manager, SandboxService\}|pub fn new\(manager: Arc<Manager>)' || true)
[ -z "$hits" ] || bad "the concrete Manager named in the server's front (use SandboxService):
$hits"

[ $fail -eq 0 ] && echo "check-deps: ok"
exit $fail
