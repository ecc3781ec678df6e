#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter (megatron-core 0.19 needs >= 3.12 and
# ships cp312 wheels), falling back to a newer Python if no 3.12 exists.
set -uo pipefail
ok() { "$@" -c 'import sys; assert sys.version_info >= (3, 12); print(sys.executable)' 2>/dev/null; }
[ -n "${PYTHON312:-}" ] && ok "$PYTHON312" && exit 0
ok python3.12 && exit 0
# pyenv machines: the 3.12 shim needs PYENV_VERSION.
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12' | sort -V -r); do
    PYENV_VERSION=$v ok pyenv exec python && exit 0
  done
fi
ok python3.13 && exit 0
ok python3 && exit 0
echo "no Python >= 3.12 found; set PYTHON312=/path/to/python3.12" >&2
exit 1
