# Sourced by the scripts in this folder: the repository root, a PATH that finds cargo-installed
# tools, and the helpers every script prints its progress with.

GRADACC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="${CARGO_HOME:-${HOME:-/root}/.cargo}/bin:$PATH"

# Output differs between cbindgen releases, so the header is only ever generated with this one.
CBINDGEN_VERSION=0.29.4

section() { printf '\n==== %s ====\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# The crate version from Cargo.toml ([package] comes first, so the first `version =` line is its).
cargo_version() {
    sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$GRADACC_ROOT/Cargo.toml" | head -n 1
}
