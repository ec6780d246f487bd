# Shared by the .ci scripts (sourced, not run).

_ci_start=$SECONDS

step() {  # a visible, timed section header
    echo
    echo "=== $* ($((SECONDS - _ci_start)) s since start)"
}

pytest_must_run() {  # run a pytest command; its exit code 5 (no tests collected) is a failure, not a pass
    local rc=0
    "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "error: '$*' collected no tests (pytest exit code 5)" >&2
        return 1
    fi
    return "$rc"
}
