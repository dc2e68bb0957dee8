#!/bin/sh
# Creates, as the calling user, the host folders the compose services write: RUNS_DIR and FEATURES_DIR from
# the env file (default docker/.env). Docker would create a missing one as root, and the containers, which
# run as XMODAL_UID, could not write it. Relative paths are resolved from docker/, as compose does.
#   docker/dirs.sh [ENV_FILE]        (or `make docker-dirs DOCKER_ENV=ENV_FILE`)
set -eu
docker_dir=$(cd "$(dirname "$0")" && pwd)
env_file=${1:-$docker_dir/.env}
if [ ! -f "$env_file" ]; then
    echo "$env_file is missing: cp docker/.env.example docker/.env and edit it" >&2
    exit 1
fi

# The last NAME=value line of the env file, surrounding quotes removed (the file is not run as shell).
value() {
    sed -n "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*//p" "$env_file" | tail -n 1 \
        | sed -e 's/[[:space:]]*$//' -e 's/^"\(.*\)"$/\1/' -e "s/^'\(.*\)'$/\1/"
}

runs=$(value RUNS_DIR)
features=$(value FEATURES_DIR)
if [ -z "$features" ]; then
    echo "set FEATURES_DIR in $env_file" >&2
    exit 1
fi
cd "$docker_dir"
for dir in "${runs:-../runs}" "$features"; do
    mkdir -p "$dir"
    if [ ! -w "$dir" ]; then
        echo "$dir: not writable by $(id -u):$(id -g); chown it to XMODAL_UID:XMODAL_GID" >&2
        exit 1
    fi
    echo "$(cd "$dir" && pwd): ready, owned by $(stat -c %u:%g "$dir")"
done
