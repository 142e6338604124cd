#!/usr/bin/env bash
# Regenerates the README's benchmark section and docs/bench/: builds the release binary
# (profile-guided, scripts/pgo.sh) and the plain `cargo build --release` one, then runs every
# scenario with the release build measured as `tailgate` and the plain build beside it as
# `tailgate-plain`. The plain build drives the run (load generator, upstream), so those are
# the same binary as in runs before the release build was profile-guided.
# Extra arguments go to `tailgate bench report` (e.g. --rounds 7).
# Needs nginx and HAProxy installed to measure them (scripts/test.sh installs both as root).
set -euo pipefail
cd "$(dirname "$0")/.."
# The plain build first (minutes), and the options checked with it, so that a mistyped one
# fails before the profile-guided build (two more builds) rather than after it.
cargo build --release --locked -p tailgate-cli
target/release/tailgate bench report --check --tailgate target/release/tailgate \
  --compare tailgate-plain=target/release/tailgate "$@"
scripts/pgo.sh
exec target/release/tailgate bench report --tailgate target/pgo/tailgate \
  --compare tailgate-plain=target/release/tailgate "$@"
