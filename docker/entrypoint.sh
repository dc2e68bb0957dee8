#!/bin/sh
# The image's entry point: checks what the container needs, then runs its arguments (`xmodal ...` by default,
# `ray start ...` on the compose Ray nodes), so a misconfiguration stops with one line saying what to do.
# XMODAL_WRITES lists the folders the service writes (set per service in docker/docker-compose.yml);
# XMODAL_NEEDS, the files it or a later stage reads; XMODAL_EXTRA_ARGS, arguments appended to the command,
# split at spaces, never expanded as file patterns.
set -eu

for dir in ${XMODAL_WRITES:-}; do
    if [ ! -d "$dir" ] || [ ! -w "$dir" ]; then
        echo "xmodal: $dir is not writable by uid $(id -u) gid $(id -g): the host folder mounted there must" \
            "belong to XMODAL_UID:XMODAL_GID (docker/.env); create it as yourself with \`make docker-dirs\`" \
            "or chown it (Docker creates a missing folder as root)" >&2
        exit 1
    fi
done

# XMODAL_NEEDS lists files this stage or a later one reads: missing, the pipeline stops now, not after hours.
for file in ${XMODAL_NEEDS:-}; do
    if [ ! -f "$file" ] || [ ! -r "$file" ]; then
        echo "xmodal: $file is missing or unreadable, and a stage of the pipeline reads it: put it in the" \
            "host folder mounted there (docker/.env names the folder and the file) before starting" >&2
        exit 1
    fi
done

if [ "${1:-}" = ray ] && [ "${RAY_AUTH_MODE:-}" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
    echo "xmodal: RAY_AUTH_TOKEN is empty: set it in docker/.env (\`ray get-auth-token --generate\`" \
        "prints one) before starting the Ray nodes" >&2
    exit 1
fi

# `xmodal` finds itself a private HOME (pipelines/jobs/home.py); other commands (`ray start`) get the same
# here: the image's home belongs to its user alone, and Ray writes its token under ~.
if [ "${1:-}" != xmodal ] && { [ ! -O "${HOME:-/}" ] || [ ! -w "${HOME:-/}" ]; }; then
    private="${TMPDIR:-/tmp}/xmodal-home-$(id -u)"
    mkdir -m 700 -p "$private"
    if [ ! -O "$private" ] || [ -n "$(find "$private" -maxdepth 0 -perm /077)" ]; then
        echo "xmodal: $private is not a private folder of uid $(id -u); remove it, or set HOME to a folder" \
            "you own" >&2
        exit 1
    fi
    export HOME="$private"
fi

if [ -n "${XMODAL_EXTRA_ARGS:-}" ]; then
    set -f
    # shellcheck disable=SC2086 # split at spaces on purpose: one variable carries several arguments
    set -- "$@" $XMODAL_EXTRA_ARGS
    set +f
fi

exec "$@"
