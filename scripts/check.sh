#!/usr/bin/env bash
# Static checks that keep the project's shape: lint, format, types, import layers.
#   bash scripts/check.sh        # one line per check; exit status 1 if any failed
#
# Every check runs even after one fails, so a single run lists everything to fix;
# a failing check's own output is printed above its line. The tools are pinned
# (the same pins as the `dev` extra in pyproject.toml) because a newer ruff or
# mypy may flag or reformat code that an older one accepted; a missing tool or
# one at another version is installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
PINS=("ruff==0.17.6" "mypy==2.4.1" "import-linter==2.16")

missing=()
for pin in "${PINS[@]}"; do
    name=${pin%%==*} version=${pin##*==}
    have=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
    [ "$have" = "$version" ] || missing+=("$pin")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "check: installing ${missing[*]}"
    "$PY" -m pip install --quiet --disable-pip-version-check "${missing[@]}" || exit 1
fi

failed=0
run_check() {
    local label=$1
    shift
    local output
    if output=$("$@" 2>&1); then
        echo "ok      $label"
    else
        printf '%s\n' "$output"
        echo "FAILED  $label"
        failed=1
    fi
}

run_check "ruff check ." "$PY" -m ruff check .
run_check "ruff format --check ." "$PY" -m ruff format --check .
run_check "mypy pipeckpt" "$PY" -m mypy pipeckpt
# lint-imports puts the working directory first on sys.path, so it reads this
# checkout's pipeckpt even where another one is installed.
SCRIPTS=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
run_check "lint-imports" "$SCRIPTS/lint-imports" --no-logo
exit $failed
