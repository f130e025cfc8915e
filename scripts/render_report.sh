#!/usr/bin/env bash
# Renders a sweep's report.html in Debian's headless Chromium to a PNG screenshot, to look at
# the report as a user sees it (the charts are inlined, so nothing is fetched).
#
#   scripts/render_report.sh DIR [WIDTH] [HEIGHT]
#
# Writes DIR/report.png (default 1400 × 6000 px; the page is cut at HEIGHT). Needs chromium
# (`apt-get install chromium`).
set -euo pipefail
dir=${1:?usage: scripts/render_report.sh SWEEP_DIR [WIDTH] [HEIGHT]}
width=${2:-1400}
height=${3:-6000}
html="$dir/report.html"
[ -f "$html" ] || { echo "no $html: run \`vitscale report $dir\` first" >&2; exit 1; }
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "chromium not found: apt-get install chromium" >&2; exit 1; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
abs=$(cd "$(dirname "$html")" && pwd)/report.html
out=$(cd "$dir" && pwd)/report.png
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --hide-scrollbars --window-size="$width,$height" \
  --screenshot="$out" "file://$abs" 2>"$profile/chromium.log" || { cat "$profile/chromium.log" >&2; exit 1; }
[ -s "$out" ] || { echo "chromium wrote no screenshot" >&2; cat "$profile/chromium.log" >&2; exit 1; }
echo "$out"
