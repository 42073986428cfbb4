#!/usr/bin/env bash
# The fence around the core, from both sides:
#
#   check_boundaries.sh includes SOURCE_DIR
#     ctest Layout.LibrariesReachTheCoreThroughItsDoor: no file under optim/, tp/, checkpoint/,
#     data/, pp/, tools/, examples/, benchmarks/ or programs/ includes an fsdp/internal/ header
#     other than the door (fsdp/internal/core_access.h) and the check macros (fsdp/internal/check.h).
#
#   check_boundaries.sh exports BUILD_DIR
#     ctest Install.ExportsOnlyThePublicAPI: the installed libraries (cmake --install into a
#     temporary prefix) export, by `nm -D --defined-only`, no symbol naming RunState and none of
#     the core's internal classes (Unit, Access, MeshState, BufferPool, StepWatch: members,
#     typeinfo, vtables), and do export what must cross a
#     library boundary: the door's functions and the typeinfo of the polymorphic classes that
#     programs catch or cast across .so files (fsdp::Error, fsdp::SplitModule, fsdp::ShardedUnit).
#
# Exit status 0 when the fence holds, 1 with each offending include or symbol listed.
set -euo pipefail
mode=${1:?usage: check_boundaries.sh includes SOURCE_DIR | exports BUILD_DIR}
dir=${2:?usage: check_boundaries.sh includes SOURCE_DIR | exports BUILD_DIR}
fail=0

if [[ $mode == includes ]]; then
  cd "$dir"
  for folder in optim tp checkpoint data pp tools examples benchmarks programs; do
    [[ -d $folder ]] || continue
    while IFS= read -r hit; do
      echo "check_boundaries: $hit: only fsdp/internal/core_access.h and fsdp/internal/check.h may be included" \
           "from outside fsdp/ (reach the core through the door)"
      fail=1
    done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]fsdp/internal/' "$folder" \
               --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh' |
             grep -vE '[<"]fsdp/internal/(core_access|check)\.h[>"]' || true)
  done
  ((fail == 0)) && echo "check_boundaries: every library outside fsdp/ reaches the core through its door"
  exit $fail
fi

[[ $mode == exports ]] || { echo "check_boundaries: unknown mode '$mode'" >&2; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$dir" --prefix "$tmp/prefix" >/dev/null
libs=("$tmp"/prefix/lib/libtorch_fsdp*.so)
[[ -e ${libs[0]} ]] || { echo "check_boundaries: no libtorch_fsdp*.so installed under lib/"; exit 1; }
nm -DC --defined-only "${libs[@]}" >"$tmp/symbols.txt"
# RunState anywhere (no signature may name it); the other internal classes by their own symbols:
# members, typeinfo, vtables (a function of a public header may take a Unit& as an opaque handle).
internals='RunState|fsdp::detail::(Unit|Access|MeshState|BufferPool|StepWatch)::|(typeinfo|typeinfo name|vtable) for fsdp::detail::(Unit|Access|MeshState|BufferPool|StepWatch)\b'
if grep -E "$internals" "$tmp/symbols.txt" >"$tmp/leaks.txt"; then
  echo "check_boundaries: $(wc -l <"$tmp/leaks.txt") exported symbol(s) of the core's internals, e.g.:"
  head -n 20 "$tmp/leaks.txt"
  fail=1
fi
for want in 'fsdp::detail::agree(' 'fsdp::detail::all_reduce(' 'fsdp::detail::checkpoint_group(' \
            'typeinfo for fsdp::Error' 'typeinfo for fsdp::SplitModule' 'typeinfo for fsdp::ShardedUnit' \
            'fsdp::FSDPModule::FSDPModule(' 'fsdp::checkpoint::save('; do
  grep -qF "$want" "$tmp/symbols.txt" || { echo "check_boundaries: '$want' is not exported"; fail=1; }
done
n=$(wc -l <"$tmp/symbols.txt")
((fail == 0)) && echo "check_boundaries: ${#libs[@]} libraries export $n symbols, none of the core's internals"
exit $fail
