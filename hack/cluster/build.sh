#!/usr/bin/env bash
# Builds the dev cluster's binaries (kube-apiserver, kube-controller-manager,
# kube-scheduler, etcd, the nodes' kubelet and kube-proxy, and crictl to inspect them) from the Go modules
# pinned in this folder,
# into a cache folder keyed by version:
#   ${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/k8s/<k8s version>/bin/
# A stamp file records the hash of the inputs (go.mod, go.sum, main.go, this
# script), so a second run with nothing changed returns in well under a second;
# after a change, Go's own module and build caches make the rebuild cheap.
#
# Usage: hack/cluster/build.sh [--force] [--print-bindir]
# Env:   KVPILOT_CACHE, GOPROXY, GOTOOLCHAIN (honoured as usual), BUILD_NICE (default 10)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../lib/buildflags.sh
source "$here/../lib/buildflags.sh"
parse_build_flags build.sh --print-bindir "$@"

LOG_TAG=build.sh
# die, step, go_download and go_progress, shared with hack/tools/build.sh.
# shellcheck source=../lib/gobuild.sh
source "$here/../lib/gobuild.sh"

# Versions come from the go.mod files, so there is a single place to bump them.
k8s_version="$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$here/go.mod")"
etcd_version="$(awk '$1=="require" && $2=="go.etcd.io/etcd/server/v3" {print $3}' "$here/etcd/go.mod")"
crictl_version="$(awk '$1=="require" && $2=="sigs.k8s.io/cri-tools" {print $3}' "$here/crictl/go.mod")"
[[ -n "$k8s_version" ]] || die "cannot read the k8s.io/kubernetes version from $here/go.mod"
[[ -n "$etcd_version" ]] || die "cannot read the etcd version from $here/etcd/go.mod"
[[ -n "$crictl_version" ]] || die "cannot read the cri-tools version from $here/crictl/go.mod"

bindir="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/k8s/${k8s_version}/bin"
if [[ $print_only == 1 ]]; then
    echo "$bindir"
    exit 0
fi

stamp="$bindir/.inputs.sha256"
inputs_hash="$(cat "$here/go.mod" "$here/go.sum" "$here/tools.go" "$here/../lib/gobuild.sh" \
    "$here/etcd/go.mod" "$here/etcd/go.sum" "$here/etcd/main.go" \
    "$here/crictl/go.mod" "$here/crictl/go.sum" "$here/crictl/tools.go" "$0" | sha256sum | cut -d' ' -f1)"
binaries=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy etcd crictl)

all_present() {
    local b
    for b in "${binaries[@]}"; do [[ -x "$bindir/$b" ]] || return 1; done
}
up_to_date() {
    [[ $force == 0 ]] && all_present && [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$inputs_hash" ]]
}
if up_to_date; then
    step "up to date: $bindir (k8s $k8s_version, etcd $etcd_version)"
    exit 0
fi

mkdir -p "$bindir"
# One build at a time (two checkouts' test runs share this cache): two builds of one binary raced on its
# .tmp file and one failed. The next waits, then finds the binaries up to date.
exec 9>"$bindir/.lock"
if ! flock -n 9; then
    step "waiting for another build of the cluster binaries to finish"
    flock 9
    if up_to_date; then
        step "up to date: $bindir (k8s $k8s_version, etcd $etcd_version)"
        exit 0
    fi
fi

command -v go >/dev/null || die "the 'go' command is not on PATH (need Go >= 1.26)"
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"
nice_cmd=(nice -n "${BUILD_NICE:-10}")

go_download "$here"
go_download "$here/etcd"
go_download "$here/crictl"

# Version ldflags, as kubernetes' hack/lib/version.sh sets them, so /version
# reports the pinned release instead of v0.0.0-master.
minor="${k8s_version#v*.}"; minor="${minor%%.*}"
major="${k8s_version#v}"; major="${major%%.*}"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X ${pkg}.gitVersion=${k8s_version}"
    ldflags+=" -X ${pkg}.gitMajor=${major} -X ${pkg}.gitMinor=${minor}"
    ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=${build_date}"
    ldflags+=" -X ${pkg}.gitCommit=module-${k8s_version}"
done

build() {
    local name="$1" dir="$2" pkg="$3" flags="$4" t0=$SECONDS
    step "building $name ($pkg)"
    # pipefail makes a failing go build fail the pipeline.
    (cd "$dir" && "${nice_cmd[@]}" go build -v -trimpath -ldflags "$flags" \
        -o "$bindir/$name.tmp" "$pkg" 2>&1) | go_progress "$name"
    mv -f "$bindir/$name.tmp" "$bindir/$name"
    step "built $bindir/$name in $((SECONDS - t0))s"
}

rm -f "$stamp"
t_start=$SECONDS
build etcd "$here/etcd" . "-s -w"
build kube-apiserver "$here" k8s.io/kubernetes/cmd/kube-apiserver "$ldflags"
build kube-controller-manager "$here" k8s.io/kubernetes/cmd/kube-controller-manager "$ldflags"
build kube-scheduler "$here" k8s.io/kubernetes/cmd/kube-scheduler "$ldflags"
build kubelet "$here" k8s.io/kubernetes/cmd/kubelet "$ldflags"
build kube-proxy "$here" k8s.io/kubernetes/cmd/kube-proxy "$ldflags"
build crictl "$here/crictl" sigs.k8s.io/cri-tools/cmd/crictl \
    "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$crictl_version"

reported="$("$bindir/kube-apiserver" --version 2>&1 || true)"
[[ "$reported" == *"$k8s_version"* ]] || die "kube-apiserver --version says '$reported', expected $k8s_version"
echo "$inputs_hash" > "$stamp"
step "done in $((SECONDS - t_start))s: $bindir ($reported, etcd $etcd_version)"
