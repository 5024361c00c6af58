#!/usr/bin/env bash
# gradacc-info <path> <version>: the program exits 0 and prints the whole report, starting with
# the library's version and naming every section.
set -euo pipefail
out=$("$1")
for line in "^gradacc $2 (" "^backends:$" "^  MPI: " "^libraries:$" "^environment:$"; do
    grep -q "$line" <<<"$out" || { printf 'no line matching %s in:\n%s\n' "$line" "$out"; exit 1; }
done
