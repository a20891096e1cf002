#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 20; CI runs 15; run longer by
# hand: `scripts/fuzz.sh 600`, or `scripts/fuzz.sh 3600 agent_multipart`). The corpus grows in
# fuzz/corpus/<target> (kept between runs, not committed), seeded from fuzz/seeds/<target>.
# A crash or invariant failure leaves its input in fuzz/artifacts/<target>/ and fails the run;
# reproduce it with `cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>`.
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`); without them the run
# fails, or is skipped with KILN_ALLOW_SKIPS=1.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$KILN_ROOT"
need_cargo

secs=${1:-20}
shift || true
case $secs in '' | *[!0-9]*) die "usage: scripts/fuzz.sh [seconds] [target ...]" ;; esac

missing=""
rustup toolchain list 2>/dev/null | grep -q '^nightly' || missing="the nightly toolchain (rustup toolchain install nightly)"
cargo +nightly fuzz --version >/dev/null 2>&1 || missing="${missing:+$missing and }cargo-fuzz (cargo install cargo-fuzz)"
if [ -n "$missing" ]; then
  if [ "${KILN_ALLOW_SKIPS:-}" = 1 ]; then
    echo "skipped: fuzzing needs $missing"
    exit 0
  fi
  die "fuzzing needs $missing (KILN_ALLOW_SKIPS=1 skips)"
fi

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

say "building the fuzz targets (nightly, AddressSanitizer)"
cargo +nightly fuzz build --release

failed=()
for t in "${targets[@]}"; do
  say "fuzzing $t for ${secs}s"
  mkdir -p "fuzz/corpus/$t"
  seeds=()
  [ -d "fuzz/seeds/$t" ] && seeds=("fuzz/seeds/$t")
  # -timeout: one input taking over 10 s is a hang; -rss_limit_mb: a leak or runaway allocation.
  if ! cargo +nightly fuzz run --release "$t" "fuzz/corpus/$t" "${seeds[@]}" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 2> "fuzz/$t.log"; then
    tail -n 40 "fuzz/$t.log" >&2
    failed+=("$t")
  else
    grep -E '^stat::number_of_executed_units|^Done' "fuzz/$t.log" | tr '\n' ' ' >&2
    echo >&2
    rm -f "fuzz/$t.log"
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  die "fuzz targets failed: ${failed[*]} (inputs in fuzz/artifacts/, logs fuzz/<target>.log)"
fi
say "fuzzing: ${#targets[@]} targets ran ${secs}s each without a finding"
