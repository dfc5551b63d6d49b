# Helpers for the scripts that compile Go tools from pinned modules (hack/cluster/build.sh,
# hack/tools/build.sh). Source it after setting LOG_TAG, and hash this file into the build's stamp.

die() { echo "$LOG_TAG: ERROR: $*" >&2; exit 1; }
step() { printf '[%s %s] %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*" >&2; }

# Fails fast, with the module's name, when the proxy does not serve something: downloading is cheap
# next to compiling, so do it all first.
go_download() {
    local dir="$1" out
    step "checking and downloading modules for $(basename "$dir") (GOPROXY=$(go env GOPROXY))"
    if ! out="$(cd "$dir" && go mod download 2>&1)"; then
        echo "$out" | grep -E 'not found|404|410|disabled|invalid version|unknown revision|verifying|toolchain' >&2 || echo "$out" >&2
        die "a module needed by $dir/go.mod is not served by $(go env GOPROXY), or needs a newer Go (try GOTOOLCHAIN=go1.27.3); see above"
    fi
}

# Reads `go build -v` output (one package path a line) and prints a running count of compiled
# packages, so a long first build shows it is alive; errors and warnings pass through.
go_progress() {
    local name="$1" n=0 line
    while IFS= read -r line; do
        if [[ "$line" == *" "* || "$line" == *:* ]]; then
            echo "$line" >&2
        else
            n=$((n + 1))
            if (( n % 100 == 0 )); then step "$name: $n packages compiled"; fi
        fi
    done
    step "$name: $n packages compiled in this run"
}
