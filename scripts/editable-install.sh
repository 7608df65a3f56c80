#!/usr/bin/env bash
# Install dcr in editable mode into the environment of PYTHON, one install at a time.
#
#   scripts/editable-install.sh PYTHON [SPEC] [PIP OPTIONS...]
#
# An editable install builds dcr's C kernels into the source tree (dcr/_kernels*.so); `make test`
# builds its three environments side by side, so their installs of dcr take turns on a lock.
set -euo pipefail

cd "$(dirname "$0")/.."

PYTHON="$1"
SPEC="${2:-.}"
shift $(($# < 2 ? $# : 2))

mkdir -p build
exec 9>build/.editable-install.lock
flock 9
# pip warns once per package about index locations that do not exist here; drop that noise.
"$PYTHON" -m pip install --quiet "$@" -e "$SPEC" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
