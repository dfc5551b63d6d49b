#!/usr/bin/env bash
# make lint: mypy over the kvpilot package. Run from the repo root: PY=.venv/bin/python bash hack/typecheck.sh
#
# Why a staging tree: the checkout's folders daemon/, operator/, router/ and kernels/ are the packages
# kvpilot.daemon, kvpilot.operator, ... only through setuptools' package-dir mapping (pyproject.toml),
# which mypy cannot follow; and the checkout itself must never be on sys.path (operator/ would shadow the
# standard library's `operator`). So mypy runs in a temporary folder holding kvpilot/ as links to the
# checkout's files, laid out as the installed package is; its errors name kvpilot/daemon/..., i.e. the
# checkout's daemon/... Its cache stays in the checkout's .mypy_cache (gitignored): reruns are fast.
set -euo pipefail

root=$(pwd)
[ -f "$root/pyproject.toml" ] && [ -d "$root/kvpilot" ] || { echo "run from the repo root" >&2; exit 2; }
py=${PY:-.venv/bin/python}
case $py in /*) ;; *) py=$root/$py ;; esac

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -rs "$root/kvpilot" "$stage/kvpilot"
for d in daemon operator router kernels; do
    cp -rs "$root/$d" "$stage/kvpilot/$d"
done
# the links point into the checkout: leave out its bytecode caches
find "$stage" -name __pycache__ -prune -exec rm -rf {} +

cd "$stage"
"$py" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p kvpilot "$@"
