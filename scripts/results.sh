#!/bin/sh
# Regenerate every file in results/ with the current code, then print docs/results.md's table.
# Run it on a quiet machine: timings taken while others use the cores are meaningless.
#   scripts/results.sh                    everything (about 25 minutes on 2 cores)
#   scripts/results.sh --only overhead    one or a few jobs (names: --help)
cd "$(dirname "$0")/.." && exec python -m brigade.results "$@"
