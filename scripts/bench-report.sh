#!/usr/bin/env bash
# Regenerates the README's benchmark section and docs/bench/: builds the release binary
# (profile-guided, scripts/pgo.sh) and the plain `cargo build --release` one, then runs every
# scenario with the release build as `tailgate` and the plain build beside it as
# `tailgate-plain`. Extra arguments go to `tailgate bench report` (e.g. --rounds 7).
# Needs nginx and HAProxy installed to measure them (scripts/test.sh installs both as root).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/pgo.sh
cargo build --release --locked -p tailgate-cli
exec target/pgo/tailgate bench report --compare tailgate-plain=target/release/tailgate "$@"
