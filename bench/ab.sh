#!/usr/bin/env bash
# Run one benchmark on two commits side by side, alternating, so that both see the same
# machine: each from a git worktree of its commit, with this checkout's Python environment
# (the worktree's own code comes first on the path). JSON results go to OUT/<commit>-<n>/.
#
#   bash bench/ab.sh BASE HEAD REPEATS OUT -- python -m bench.fused_throughput --ks 1 8
#
# The command gets `--out-dir OUT/<commit>-<n> --no-append` added; its tables go to
# OUT/<commit>-<n>.log.
set -euo pipefail
if [ "$#" -lt 6 ] || [ "$5" != "--" ]; then
  echo "usage: bash bench/ab.sh BASE HEAD REPEATS OUT -- COMMAND..." >&2
  exit 2
fi
base=$1 head=$2 repeats=$3 out=$4
shift 5
repo=$(git rev-parse --show-toplevel)
mkdir -p "$out"
out=$(cd "$out" && pwd)
trees=()
cleanup() { for t in "${trees[@]}"; do git -C "$repo" worktree remove --force "$t"; done; }
trap cleanup EXIT
for rev in "$base" "$head"; do
  tree=$(mktemp -d)/tree
  git -C "$repo" worktree add -q --detach "$tree" "$rev"
  trees+=("$tree")
done
for n in $(seq "$repeats"); do
  for i in 0 1; do
    rev=$([ "$i" = 0 ] && echo "$base" || echo "$head")
    label="$(git -C "$repo" rev-parse --short "$rev")-$n"
    echo "== $label: $*"
    (cd "${trees[$i]}" && "$@" --out-dir "$out/$label" --no-append) > "$out/$label.log" 2>&1
    tail -n 25 "$out/$label.log"
  done
done
