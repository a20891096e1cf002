#!/usr/bin/env bash
# The main job: build kiln, then `kiln serve` prepares what the host lacks (apt packages when
# root, the base template) and serves. Extra arguments go to `kiln serve`.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$KILN_ROOT"
need_cargo
install_packages cc:gcc
need_protoc
say "building kiln (release)"
cargo build --release -p kiln --bin kiln
build_static_agent
export KILN_AGENT_BIN="$STATIC_AGENT"
exec "$(target_dir)/release/kiln" serve "$@"
