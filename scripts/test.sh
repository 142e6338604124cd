#!/usr/bin/env bash
# The whole test suite, as the README states it: installs what the tests need (Debian
# packages, when run as root and missing), then formatting, lints, docs, and every test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Benchmark peers and tools the scenario tests start: nginx, HAProxy, wrk.
missing=()
for want in nginx:nginx-light haproxy:haproxy wrk:wrk; do
  cmd=${want%%:*} pkg=${want##*:}
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "warning: missing ${missing[*]}; run as root to install them (scenario peers are skipped without them)" >&2
  fi
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# rustdoc now and then fails to write a page it has just laid out ("couldn't generate
# documentation: I/O error ... No such file or directory"), and cargo to clear the old
# pages first ("failed to remove file `.../target/doc/...`: No such file or directory"),
# flakes of the file system under target/doc that pass on a second try; only those errors
# earn one retry, so a real doc warning still fails the run.
doc() { RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet; }
if ! doc_log=$(doc 2>&1); then
  printf '%s\n' "$doc_log" >&2
  if grep -qE "couldn't generate documentation: I/O error|failed to remove (file|directory) \`[^\`]*/target/doc/" <<<"$doc_log"; then
    echo "rustdoc failed to write its output; documenting once more" >&2
    doc
  else
    exit 1
  fi
elif [ -n "$doc_log" ]; then
  printf '%s\n' "$doc_log" >&2
fi
cargo test --workspace --locked
