#!/usr/bin/env bash
# The release binary, built with a profile of the gateway's own request path (LLVM
# profile-guided optimization): target/pgo/tailgate.
#
#   1. build tailgate instrumented (it counts every branch it takes);
#   2. run `tailgate bench train`: a gateway of that build under the traffic it is optimized
#      for (small HTTP/1.1 keep-alive requests above all; also bodies, HTTP/2, TLS, a closing
#      upstream, scrapes, the access log), which fails if any request fails or a gateway
#      leaves no profile;
#   3. merge the counts (llvm-profdata of rustc's own LLVM version);
#   4. build again with them: hot code laid out together, the rest out of its way.
#
# Why: at low load every request wakes the worker with cold caches, and the plain build's
# request path is spread over more code than fits in the instruction cache; the profile
# packs it (docs/tail-latency.md, "A profile-guided build"). The training runs the code as
# it is now, so the profile is never stale. Takes two release builds (10–13 minutes on
# 2 cores) plus half a minute of training.
#
# Needs llvm-profdata from the LLVM that rustc uses: $LLVM_PROFDATA (used alone when set),
# rustup's llvm-tools component, or Debian's llvm-N package (installed here when run as
# root and missing). The builds take their flags from RUSTFLAGS (plus the profile's): a
# cargo config's build.rustflags do not apply, and CARGO_ENCODED_RUSTFLAGS is refused.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dir=$root/target/pgo

if [ -n "${CARGO_ENCODED_RUSTFLAGS:-}" ]; then
  echo "pgo: CARGO_ENCODED_RUSTFLAGS is set and would replace the profile flags; unset it" >&2
  exit 1
fi
case $dir in
  *[[:space:]]*)
    echo "pgo: the checkout's path has a space ($root); RUSTFLAGS cannot carry it" >&2
    exit 1
    ;;
esac

llvm_major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
if [ -z "$llvm_major" ]; then
  echo "pgo: cannot tell rustc's LLVM version from 'rustc -vV'" >&2
  exit 1
fi

# Whether "$1" is llvm-profdata of rustc's LLVM major version (an older one cannot read the
# raw profiles the instrumented build writes).
matches() {
  command -v "$1" >/dev/null 2>&1 && "$1" --version 2>/dev/null | grep -q "LLVM version $llvm_major\."
}

find_profdata() {
  local host sysroot c
  host=$(rustc -vV | sed -n 's/^host: //p')
  sysroot=$(rustc --print sysroot)
  for c in "$sysroot/lib/rustlib/$host/bin/llvm-profdata" "llvm-profdata-$llvm_major" \
    "/usr/lib/llvm-$llvm_major/bin/llvm-profdata" llvm-profdata; do
    if matches "$c"; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}

if [ -n "${LLVM_PROFDATA:-}" ]; then
  if ! matches "$LLVM_PROFDATA"; then
    echo "pgo: LLVM_PROFDATA=$LLVM_PROFDATA is not llvm-profdata of LLVM $llvm_major (rustc's)" >&2
    exit 1
  fi
  profdata=$(command -v "$LLVM_PROFDATA")
elif ! profdata=$(find_profdata); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "pgo: installing llvm-$llvm_major (for llvm-profdata)"
    if ! { apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "llvm-$llvm_major" >/dev/null; }; then
      echo "pgo: apt-get could not install llvm-$llvm_major" >&2
    fi
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
# The gateways write their counts into profiles/ (bench train checks that each did); this
# process and the upstreams into other-profiles/, which is not used.
LLVM_PROFILE_FILE="$dir/other-profiles/%p.profraw" "$dir/train/release/tailgate" bench train \
  --profile-file "$dir/profiles/gateway-%p.profraw"

echo "pgo: 3/4 merging"
shopt -s nullglob
raw=("$dir"/profiles/gateway-*.profraw)
shopt -u nullglob
if [ ${#raw[@]} -ne 2 ]; then
  echo "pgo: expected the profiles of 2 gateways in $dir/profiles, found ${#raw[@]}" >&2
  exit 1
fi
"$profdata" merge -o "$dir/tailgate.profdata" "${raw[@]}"

echo "pgo: 4/4 optimized build (target/pgo/build)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$dir/tailgate.profdata" \
  cargo build --release --locked -p tailgate-cli --target-dir "$dir/build"
version=$("$dir/build/release/tailgate" --version)
case $version in
  *"profile-guided build"*) ;;
  *)
    echo "pgo: the optimized build does not say it is profile-guided: $version" >&2
    exit 1
    ;;
esac
# A copy, then a rename: a benchmark still running the last one keeps its file.
cp "$dir/build/release/tailgate" "$dir/tailgate.new"
mv -f "$dir/tailgate.new" "$dir/tailgate"
echo "pgo: built target/pgo/tailgate ($version)"
