#!/usr/bin/env bash
# Builds an importable copy of tandem at a git revision, for before/after runs beside the
# installed tree: benchmarks/snapshot_pkg.sh REV DIR makes DIR/src (the files of REV) and
# DIR/pkg/tandem (REV's tandem/ with its mapped subpackages linked in, as pyproject.toml's
# package-dir maps them). Then `PYTHONPATH=DIR/pkg python -m tandem.cli ...` runs REV, e.g.
#   python benchmarks/serve_compare.py --servers tandem-before,tandem-async \
#     "--server-cmd=tandem-before=env PYTHONPATH=DIR/pkg python -m tandem.cli serve --port {port}"
set -euo pipefail
rev="$1"
dir="$2"
root="$(cd "$(dirname "$0")/.." && pwd)"
rm -rf "$dir"
mkdir -p "$dir/src" "$dir/pkg"
git -C "$root" archive "$rev" | tar -x -C "$dir/src"
cp -r "$dir/src/tandem" "$dir/pkg/tandem"
for sub in core kv models plugins spec_decode structured_output; do
  ln -s "$dir/src/$sub" "$dir/pkg/tandem/$sub"
done
echo "$dir/pkg"
