# The flags every build script here takes: --force (rebuild even when the inputs stamp says nothing changed),
# --print-<what> (print where the result is, build nothing) and --help (the script's header).
# Usage: parse_build_flags NAME PRINT_FLAG "$@"   sets force=0|1 and print_only=0|1.
parse_build_flags() {
    local name="$1" print_flag="$2" arg
    shift 2
    force=0
    print_only=0
    for arg in "$@"; do
        case "$arg" in
            --force) force=1 ;;
            "$print_flag") print_only=1 ;;
            -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
            *) echo "$name: unknown argument: $arg" >&2; exit 2 ;;
        esac
    done
}
