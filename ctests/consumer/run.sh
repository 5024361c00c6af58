#!/usr/bin/env bash
# Installs an already-built gradacc into a scratch prefix, then builds and runs consumer.c against
# that prefix only: through find_package (shared and static targets) and through pkg-config.
# With --prefix=<dir> instead of a build folder, gradacc is already installed there (a Debian
# package, scripts/deb-check); --prefix=/usr is the system's, found with no search hints at all.
# Usage: run.sh <gradacc build dir | --prefix=dir> <scratch dir> <version to require> [<config> [<C compiler>]]
set -euo pipefail

build_dir=$1 work=$2 version=$3 config=${4:-} cc=${5:-cc}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

rm -rf "$work"
mkdir -p "$work"
if [[ $build_dir == --prefix=* ]]; then
    prefix=${build_dir#--prefix=}
    echo "-- gradacc installed in $prefix"
else
    prefix=$work/prefix
    echo "-- install into $prefix"
    cmake --install "$build_dir" --prefix "$prefix" ${config:+--config "$config"}
fi
# The system prefix is searched by default: passing it would hide a package that is not found there.
hints=()
[ "$prefix" = /usr ] || hints=(-DCMAKE_PREFIX_PATH="$prefix")

# The shared library is installed as libgradacc.so.<version> with the links libgradacc.so.<abi>
# (its SONAME, what programs load) and libgradacc.so (what -lgradacc finds). <abi> is what may not
# change without breaking callers: the major version, or 0.<minor> while the major is 0.
full=$(sed -n 's/^#define GRADACC_VERSION_STRING "\([0-9]*\.[0-9]*\.[0-9]*\).*"/\1/p' "$prefix/include/gradacc.h")
case $full in
    0.*) abi=${full%.*} ;;
    *) abi=${full%%.*} ;;
esac
shared_dir=$(dirname "$(find "$prefix"/lib* -name "libgradacc.so.$full" | head -n 1)")
[ -f "$shared_dir/libgradacc.so.$full" ] && [ ! -L "$shared_dir/libgradacc.so.$full" ] ||
    { echo "libgradacc.so.$full is not installed as a file"; ls -l "$prefix"/lib*; exit 1; }
[ "$(readlink "$shared_dir/libgradacc.so.$abi")" = "libgradacc.so.$full" ] &&
    [ "$(readlink "$shared_dir/libgradacc.so")" = "libgradacc.so.$abi" ] ||
    { echo "the libgradacc.so links are wrong (expected libgradacc.so -> libgradacc.so.$abi -> libgradacc.so.$full):"; ls -l "$shared_dir"; exit 1; }
soname=$(readelf -d "$shared_dir/libgradacc.so.$full" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libgradacc.so.$abi" ] ||
    { echo "libgradacc.so.$full has the SONAME '${soname:-none}', expected libgradacc.so.$abi"; exit 1; }

# gradacc-info runs from the prefix with no search path set, and reports the library it came with.
echo "-- gradacc-info"
info=$(env -u LD_LIBRARY_PATH "$prefix/bin/gradacc-info")
grep -q "^gradacc $full ($(readlink -f "$shared_dir/libgradacc.so.$full"))$" <<<"$info" ||
    { echo "gradacc-info does not report the installed library:"; echo "$info"; exit 1; }

echo "-- find_package(gradacc $version)"
cmake -S "$here" -B "$work/build" "${hints[@]}" -DCMAKE_C_COMPILER="$cc" \
    -DCMAKE_BUILD_TYPE=Release -DGRADACC_REQUIRED_VERSION="$version"
cmake --build "$work/build"

echo "-- consumer_shared"
"$work/build/consumer_shared"
# It records the SONAME and runs against the installed library, not the one in the build tree
# (compared as real paths: the system's loader may name /usr/lib through the /lib link).
ldd_out=$(ldd "$work/build/consumer_shared")
loaded=$(sed -n "s/^[[:space:]]*libgradacc\.so\.$abi => \(.*\) (0x.*/\1/p" <<<"$ldd_out")
[ -n "$loaded" ] ||
    { echo "consumer_shared does not record the SONAME libgradacc.so.$abi:"; echo "$ldd_out"; exit 1; }
[ "$(readlink -f "$loaded")" = "$(readlink -f "$shared_dir/libgradacc.so.$full")" ] ||
    { echo "consumer_shared loads $loaded, not the library installed in $shared_dir:"; echo "$ldd_out"; exit 1; }

echo "-- consumer_static"
"$work/build/consumer_static"
! ldd "$work/build/consumer_static" | grep -q libgradacc ||
    { echo "consumer_static still needs libgradacc.so"; exit 1; }

echo "-- pkg-config"
pc=$(find "$prefix"/lib* -name gradacc.pc)
[ -n "$pc" ] || { echo "gradacc.pc is not installed"; exit 1; }
[ "$prefix" = /usr ] || export PKG_CONFIG_PATH=$(dirname "$pc")
[ "$(pkg-config --modversion gradacc)" = "$(sed -n 's/^#define GRADACC_VERSION_STRING "\(.*\)"/\1/p' "$prefix/include/gradacc.h")" ] ||
    { echo "gradacc.pc version differs from the header's"; exit 1; }
libdir=$(pkg-config --variable=libdir gradacc)
# shellcheck disable=SC2046  # pkg-config prints several words on purpose
"$cc" -std=c99 -pedantic -Wall -Wextra -Werror "$here/consumer.c" -o "$work/consumer_pkgconfig" \
    $(pkg-config --cflags --libs gradacc) -Wl,-rpath,"$libdir"
"$work/consumer_pkgconfig"
