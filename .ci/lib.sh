# Shared by the .ci scripts (sourced, not run).

# One clock for .ci/run and the scripts it calls (each sources this file in its own shell).
export MOONCAKE_KVADDR_CI_START=${MOONCAKE_KVADDR_CI_START:-$(date +%s)}

step() {  # a visible, timed section header
    echo
    echo "=== $* ($(( $(date +%s) - MOONCAKE_KVADDR_CI_START )) s since start)"
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
