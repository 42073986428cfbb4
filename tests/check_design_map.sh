#!/usr/bin/env bash
# ctest DesignMap.ListsEverySourceFile: docs/design.md's map (its "## Map" section, up to the next
# "## " heading) names every source file (*.h, *.cpp, *.cu, *.cuh) of the library folders (fsdp/,
# optim/, tp/, checkpoint/, data/, and pp/ when it exists) by its path from the repository root,
# and names no path under those folders that does not exist. Each path is written in full: a
# brace or a glob (`fsdp/internal/comm.{h,cpp}`, `replicas.*`) is refused, so that a search for a
# file's path finds its line. The files are found by walking the source tree (no git needed).
#
#   tests/check_design_map.sh SOURCE_DIR
#
# Exit status 0 when map and tree agree, 1 with each missing, stale or abbreviated path listed.
set -euo pipefail

root=${1:?usage: check_design_map.sh SOURCE_DIR (the repository root)}
doc="$root/docs/design.md"
folders=(fsdp optim tp checkpoint data pp)
[[ -f $doc ]] || { echo "check_design_map: $doc does not exist" >&2; exit 1; }

map=$(awk '/^## Map[[:space:]]*$/ { on = 1; next } on && /^## / { exit } on' "$doc")
[[ -n $map ]] || { echo "check_design_map: docs/design.md has no '## Map' section" >&2; exit 1; }

alternatives=$(IFS='|'; echo "${folders[*]}")
# A path starts a word (not inside `examples/data/x.h`) at one of the library folders.
start="(^|[^A-Za-z0-9_./-])($alternatives)/"
strip_prefix() { sed -E 's/^[^a-z]//'; }

named=$(grep -oE "${start}[A-Za-z0-9_./-]*\.(h|cpp|cu|cuh)([^A-Za-z0-9_]|$)" <<<"$map" |
          strip_prefix | sed -E 's/[^A-Za-z0-9_]$//' | sort -u || true)
# A brace or a glob in a file's name (`comm.{h,cpp}`, `replicas.*`); a folder's `fsdp/*.h` is prose.
abbreviated=$(grep -oE "${start}[A-Za-z0-9_./-]*([A-Za-z0-9_]\.\*|\{)[^\`[:space:]]*" <<<"$map" |
                strip_prefix | sort -u || true)

on_disk=$(cd "$root" && for f in "${folders[@]}"; do
            [[ -d $f ]] || continue
            find "$f" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \)
          done | sort -u)

missing=$(comm -23 <(printf '%s\n' "$on_disk" | sed '/^$/d') <(printf '%s\n' "$named" | sed '/^$/d'))
stale=$(comm -13 <(printf '%s\n' "$on_disk" | sed '/^$/d') <(printf '%s\n' "$named" | sed '/^$/d'))

status=0
if [[ -n $missing ]]; then
  echo "docs/design.md's map does not name these source files (add a line for each, by its path):"
  sed 's/^/  missing: /' <<<"$missing"
  status=1
fi
if [[ -n $stale ]]; then
  echo "docs/design.md's map names paths that do not exist (moved or removed: update the map):"
  sed 's/^/  stale: /' <<<"$stale"
  status=1
fi
if [[ -n $abbreviated ]]; then
  echo "docs/design.md's map abbreviates paths (write each file's path in full):"
  sed 's/^/  abbreviated: /' <<<"$abbreviated"
  status=1
fi
if (( status == 0 )); then
  echo "docs/design.md's map names all $(wc -l <<<"$on_disk") source files of ${folders[*]}, and nothing else there"
fi
exit $status
