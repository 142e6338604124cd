#!/usr/bin/env bash
# The release binary, built with a profile of the gateway's own request path (LLVM
# profile-guided optimization): target/pgo/tailgate.
#
#   1. build tailgate instrumented (it counts every branch it takes);
#   2. run `tailgate bench train`: a gateway of that build under the traffic it is optimized
#      for (mostly small HTTP/1.1 keep-alive requests; also bodies, HTTP/2, TLS, a closing
#      upstream, scrapes, the access log), which fails if any request fails;
#   3. merge the counts (llvm-profdata of rustc's own LLVM version);
#   4. build again with them: hot code laid out together, the rest out of its way.
#
# Why: at low load every request wakes the worker with cold caches, and the plain build's
# request path is spread over more code than fits in the instruction cache; the profile
# packs it (docs/tail-latency.md, "A profile-guided build"). The training runs the code as
# it is now, so the profile is never stale. Takes two release builds (10–13 minutes on
# 2 cores) plus half a minute of training.
#
# Needs llvm-profdata from the LLVM that rustc uses: $LLVM_PROFDATA, rustup's llvm-tools
# component, or Debian's llvm-N package (installed here when run as root and missing).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dir=$root/target/pgo

llvm_major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
if [ -z "$llvm_major" ]; then
  echo "pgo: cannot tell rustc's LLVM version from 'rustc -vV'" >&2
  exit 1
fi

# llvm-profdata whose major version is rustc's LLVM's (an older one cannot read the raw
# profiles the instrumented build writes).
find_profdata() {
  local host sysroot c
  host=$(rustc -vV | sed -n 's/^host: //p')
  sysroot=$(rustc --print sysroot)
  for c in ${LLVM_PROFDATA:-} "$sysroot/lib/rustlib/$host/bin/llvm-profdata" \
    "llvm-profdata-$llvm_major" "/usr/lib/llvm-$llvm_major/bin/llvm-profdata" llvm-profdata; do
    if command -v "$c" >/dev/null 2>&1 &&
      "$c" --version 2>/dev/null | grep -q "LLVM version $llvm_major\."; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}

if ! profdata=$(find_profdata); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "pgo: installing llvm-$llvm_major (for llvm-profdata)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "llvm-$llvm_major" >/dev/null
  fi
  if ! profdata=$(find_profdata); then
    echo "pgo: needs llvm-profdata from LLVM $llvm_major (rustc's): apt-get install llvm-$llvm_major," >&2
    echo "     or rustup component add llvm-tools, or set LLVM_PROFDATA" >&2
    exit 1
  fi
fi
echo "pgo: llvm-profdata: $profdata"

rm -rf "$dir/profiles" "$dir/other-profiles"
mkdir -p "$dir/profiles" "$dir/other-profiles"

echo "pgo: 1/4 instrumented build (target/pgo/train)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$dir/other-profiles" \
  cargo build --release --locked -p tailgate-cli --target-dir "$dir/train"

echo "pgo: 2/4 training"
# The gateways write their counts into profiles/; this process and the upstreams into
# other-profiles/, which is not used.
LLVM_PROFILE_FILE="$dir/other-profiles/%p.profraw" "$dir/train/release/tailgate" bench train \
  --profile-file "$dir/profiles/gateway-%p.profraw"

echo "pgo: 3/4 merging"
"$profdata" merge -o "$dir/tailgate.profdata" "$dir"/profiles/gateway-*.profraw

echo "pgo: 4/4 optimized build (target/pgo/build)"
TAILGATE_PGO=1 RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$dir/tailgate.profdata" \
  cargo build --release --locked -p tailgate-cli --target-dir "$dir/build"
# A copy, then a rename: a benchmark still running the last one keeps its file.
cp "$dir/build/release/tailgate" "$dir/tailgate.new"
mv -f "$dir/tailgate.new" "$dir/tailgate"
echo "pgo: built target/pgo/tailgate ($("$dir/tailgate" --version))"
