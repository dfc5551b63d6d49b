# apt_mirror SUITE: the URI this machine's apt sources use for SUITE (deb822 `.sources` files first, then the
# one-line `sources.list` format), or nothing. APT_SOURCES_DIR (default /etc/apt) is for tests.
apt_mirror() {
    local suite="$1" dir="${APT_SOURCES_DIR:-/etc/apt}" uri=""
    shopt -s nullglob
    local sources=("$dir"/sources.list.d/*.sources) lists=("$dir"/sources.list "$dir"/sources.list.d/*.list)
    shopt -u nullglob
    if ((${#sources[@]})); then
        uri="$(awk -v want="$suite" '
            BEGIN { RS = "" }
            {
                uris = ""; hit = 0; on = 1
                n = split($0, line, "\n")
                for (i = 1; i <= n; i++) {
                    l = line[i]
                    if (l ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", l); uris = l }
                    if (l ~ /^Suites:/) {
                        sub(/^Suites:[ \t]*/, "", l)
                        m = split(l, s, /[ \t]+/)
                        for (j = 1; j <= m; j++) if (s[j] == want) hit = 1
                    }
                    if (l ~ /^Enabled:[ \t]*(no|false)/) on = 0
                }
                if (hit && on && uris != "") { split(uris, u, /[ \t]+/); print u[1]; exit }
            }' "${sources[@]}")"
    fi
    if [[ -z "$uri" ]]; then
        local f
        for f in "${lists[@]}"; do
            [[ -f "$f" ]] || continue
            uri="$(awk -v want="$suite" '
                $1 == "deb" {
                    i = 2
                    if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                    if ($(i + 1) == want) { print $i; exit }
                }' "$f")"
            [[ -n "$uri" ]] && break
        done
    fi
    printf '%s' "${uri%/}"
}
