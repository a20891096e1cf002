#!/usr/bin/env bash
# Builds the kiln microVM guest kernel (ELF vmlinux with PVH entry) from Debian's
# linux-source-6.1 and the config fragment next to this script, cached by hash.
#
#   crates/vmm/kernel/build-kernel.sh            build if needed, print the vmlinux path
#   crates/vmm/kernel/build-kernel.sh --path     print the cached path only (exit 1 if absent)
#   crates/vmm/kernel/build-kernel.sh --check-config   only resolve and verify the config
#   KILN_CACHE_DIR=/some/dir ...                 cache root (default ~/.cache/kiln)
#   KILN_KERNEL_INSTALL_DEPS=1 ...               apt-get install the build dependencies first
#
# The cache key is the sha256 of this script, the fragment and the installed linux-source-6.1
# package version, so a change to any of them builds a new kernel. Takes ~10 min on 2 cores;
# only useful on hosts whose KVM runs guest kernel code at hardware speed (see `kiln doctor`).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
fragment="$here/kiln-guest.config"
cache_root="${KILN_CACHE_DIR:-$HOME/.cache/kiln}/vmm-kernel"
deps=(linux-source-6.1 build-essential flex bison bc libelf-dev libssl-dev xz-utils)

src_version() { dpkg-query -W -f='${Version}' linux-source-6.1 2>/dev/null || echo "not-installed"; }

key() {
  { sha256sum "$fragment" "$0" | cut -d' ' -f1; src_version; } | sha256sum | cut -c1-16
}

if [[ "${KILN_KERNEL_INSTALL_DEPS:-0}" == 1 ]]; then
  missing=()
  for p in "${deps[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

out="$cache_root/$(key)"
if [[ "${1:-}" == "--path" ]]; then
  [[ -f "$out/vmlinux" ]] && { echo "$out/vmlinux"; exit 0; }
  echo "no cached kernel at $out (run $0 to build it)" >&2
  exit 1
fi
if [[ -f "$out/vmlinux" && "${1:-}" != "--check-config" ]]; then
  echo "$out/vmlinux"
  exit 0
fi

tarball=$(ls /usr/src/linux-source-6.1*.tar.xz 2>/dev/null | head -1 || true)
if [[ -z "$tarball" ]]; then
  echo "linux-source-6.1 is not installed: apt-get install ${deps[*]} (or set KILN_KERNEL_INSTALL_DEPS=1)" >&2
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "building the kiln guest kernel from $tarball in $work" >&2
tar -C "$work" -xJf "$tarball"
cd "$work"/linux-source-6.1*
make -s ARCH=x86_64 tinyconfig >/dev/null
scripts/kconfig/merge_config.sh -m .config "$fragment" >/dev/null
make -s ARCH=x86_64 olddefconfig
# every option the fragment sets must have survived dependency resolution
fail=0
while IFS= read -r line; do
  [[ "$line" =~ ^CONFIG_ ]] || continue
  if [[ "$line" == *"=n" ]]; then
    grep -q "^${line%=n}=" .config && { echo "config: ${line%=n} should be off" >&2; fail=1; }
  elif ! grep -qx "$line" .config; then
    echo "config: $line did not stick (missing dependency?)" >&2; fail=1
  fi
done < "$fragment"
((fail == 0)) || exit 1
if [[ "${1:-}" == "--check-config" ]]; then
  echo "config ok: every option of $(basename "$fragment") is set"
  exit 0
fi
make -s ARCH=x86_64 -j"$(nproc)" vmlinux
mkdir -p "$out"
cp vmlinux .config "$out/"
echo "$out/vmlinux"
