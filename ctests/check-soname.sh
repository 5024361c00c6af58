#!/usr/bin/env bash
# The `abi_soname` CTest test: the shared library's SONAME is the expected one, and a program
# linked through gradacc::gradacc records that SONAME (not a path, not the unversioned name).
# Usage: check-soname.sh <readelf> <soname> <library> <program linked to it>
set -euo pipefail
readelf=$1 soname=$2 lib=$3 program=$4

got=$("$readelf" -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$got" = "$soname" ] || { echo "$lib: SONAME is '${got:-none}', expected '$soname'"; exit 1; }
echo "$lib: SONAME $got"

needed=$("$readelf" -d "$program" | sed -n 's/.*(NEEDED).*\[\(libgradacc[^]]*\)\]/\1/p')
[ "$needed" = "$soname" ] || { echo "$program: NEEDED '${needed:-none}', expected '$soname'"; exit 1; }
echo "$program: NEEDED $needed"
