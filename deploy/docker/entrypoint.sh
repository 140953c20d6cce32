#!/usr/bin/env bash
# smddp container entrypoint (deploy/docker/Dockerfile.gpu and Dockerfile.cpu).
#
#   entrypoint.sh sshd                       a worker host: start sshd in the foreground, so that
#                                            mpirun on the launcher can start prted here
#   entrypoint.sh launch [OPTIONS] -- CMD... the launcher: wait for every host's sshd, then exec
#                                            smddp-launch --hostfile ... --iface ... OPTIONS -- CMD...
#   entrypoint.sh CMD...                     anything else is exec'd as it is (bash, smddp-launch, ...)
#
# Settings (environment; none of them is secret, and no secret is ever read from the environment):
#   SMDDP_HOSTFILE           hostfile for `launch` (default: /etc/mpi/hostfile, the MPI Operator's,
#                            when it exists; with none, smddp-launch takes -H from OPTIONS)
#   SMDDP_IFACE              network for smddp's and mpirun's traffic between hosts, an interface name
#                            or a CIDR (default: eth0, a pod's network; `auto` lets smddp choose)
#   SMDDP_SSH_PORT           port sshd listens on and the launcher waits for (default: 22)
#   SMDDP_SSH_DIR            where the ssh key pair and authorized_keys are mounted (default: ~/.ssh)
#   SMDDP_WAIT_FOR_HOSTS_S   how long `launch` waits for the hosts' sshd (default: 300; 0: no wait)
#   SMDDP_LAUNCH             the smddp-launch to run (default: smddp-launch on PATH)
#   SMDDP_SSHD               the sshd to run (default: /usr/sbin/sshd)
#   SMDDP_ENTRYPOINT_DRY_RUN 1: check the settings, print every action and the final command, change
#                            nothing and exec nothing (the tests run it this way)
set -euo pipefail

DRY_RUN="${SMDDP_ENTRYPOINT_DRY_RUN:-0}"

log() { printf 'smddp-entrypoint: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 2
}

# Runs a command that changes something, or only prints it in dry mode.
act() {
    if [[ "$DRY_RUN" == 1 ]]; then
        printf 'would run:' >&2
        printf ' %q' "$@" >&2
        printf '\n' >&2
    else
        "$@"
    fi
}

# The end of every mode: print the command in dry mode (stdout, one line, shell-quoted), else exec it.
finish() {
    if [[ "$DRY_RUN" == 1 ]]; then
        printf 'exec'
        printf ' %q' "$@"
        printf '\n'
        exit 0
    fi
    exec "$@"
}

ssh_dir() { printf '%s' "${SMDDP_SSH_DIR:-${HOME:-/root}/.ssh}"; }

# Octal permission bits of a file (GNU stat).
mode_of() { stat -L -c '%a' "$1"; }

# The ssh keys come from a Kubernetes Secret (the MPI Operator makes one per job) or a host mount,
# never from the image: refuse to start with a private key that others could read, as ssh would.
check_keys() {
    local dir key mode found=0
    dir="$(ssh_dir)"
    for key in "$dir"/id_rsa "$dir"/id_ecdsa "$dir"/id_ed25519; do
        [[ -e "$key" ]] || continue
        found=1
        mode="$(mode_of "$key")"
        if ((8#$mode & 8#077)); then
            die "$key has mode $mode; it must be readable by its owner only (mount the Secret with defaultMode 0600)"
        fi
    done
    ((found)) || log "warning: no private key (id_rsa, id_ecdsa, id_ed25519) in $dir"
}

mode_sshd() {
    local port="${SMDDP_SSH_PORT:-22}" sshd="${SMDDP_SSHD:-/usr/sbin/sshd}"
    [[ "$port" =~ ^[0-9]+$ ]] || die "SMDDP_SSH_PORT must be a number, got '$port'"
    [[ -e "$(ssh_dir)/authorized_keys" ]] || log "warning: no $(ssh_dir)/authorized_keys: the launcher will be refused"
    check_keys
    # Host keys are made when the container starts, so that no two containers of an image share them.
    if ! compgen -G '/etc/ssh/ssh_host_*_key' >/dev/null; then
        act ssh-keygen -A
    fi
    act mkdir -p -m 0755 /run/sshd # sshd's privilege separation directory
    finish "$sshd" -D -e -p "$port"
}

# Host names from a hostfile (Open MPI `host slots=N` or MPICH `host:N`; `#` starts a comment).
hostfile_hosts() {
    local line
    while IFS= read -r line || [[ -n "$line" ]]; do
        line="${line%%#*}"
        read -r line _ <<<"$line" || true
        [[ -n "$line" ]] && printf '%s\n' "${line%%:*}"
    done <"$1"
}

# Waits until sshd answers on every host, so that a launcher that starts before its workers does not
# fail in mpirun.
wait_for_hosts() {
    local hostfile="$1" limit="${SMDDP_WAIT_FOR_HOSTS_S:-300}" host deadline
    [[ "$limit" =~ ^[0-9]+$ ]] || die "SMDDP_WAIT_FOR_HOSTS_S must be a number of seconds, got '$limit'"
    ((limit > 0)) || return 0
    deadline=$((SECONDS + limit))
    while IFS= read -r host; do
        if [[ "$DRY_RUN" == 1 ]]; then
            log "would wait up to ${limit}s for ssh on $host:${SMDDP_SSH_PORT:-22}"
            continue
        fi
        # shellcheck disable=SC2016  # $1 and $2 expand in the inner bash, from its arguments
        until timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "${SMDDP_SSH_PORT:-22}" 2>/dev/null; do
            ((SECONDS < deadline)) || die "ssh on $host:${SMDDP_SSH_PORT:-22} not reachable after ${limit}s"
            sleep 2
        done
    done < <(hostfile_hosts "$hostfile")
}

mode_launch() {
    local launch="${SMDDP_LAUNCH:-smddp-launch}" iface="${SMDDP_IFACE:-eth0}" hostfile
    local -a args=()
    hostfile="${SMDDP_HOSTFILE:-}"
    if [[ -z "$hostfile" && -e /etc/mpi/hostfile ]]; then
        hostfile=/etc/mpi/hostfile
    fi
    if [[ -n "$hostfile" ]]; then
        [[ -r "$hostfile" ]] || die "cannot read hostfile $hostfile"
        args+=(--hostfile "$hostfile")
    fi
    # An interface name or an IPv4 CIDR, nothing that could be read as another option.
    if [[ "$iface" != auto ]]; then
        [[ "$iface" =~ ^[A-Za-z0-9][A-Za-z0-9_.:@/-]*$ ]] || die "SMDDP_IFACE must be an interface name or a CIDR, got '$iface'"
        args+=(--iface "$iface")
    fi
    [[ $# -gt 0 ]] || die "usage: entrypoint.sh launch [smddp-launch options] -- COMMAND [ARGS...]"
    check_keys
    if [[ -n "$hostfile" ]]; then
        wait_for_hosts "$hostfile"
    fi
    finish "$launch" "${args[@]}" "$@"
}

main() {
    [[ "$DRY_RUN" == 0 || "$DRY_RUN" == 1 ]] || die "SMDDP_ENTRYPOINT_DRY_RUN must be 0 or 1"
    if [[ $# -eq 0 ]]; then
        die "usage: entrypoint.sh sshd | launch [OPTIONS] -- COMMAND... | COMMAND..."
    fi
    case "$1" in
        sshd)
            shift
            mode_sshd "$@"
            ;;
        launch)
            shift
            mode_launch "$@"
            ;;
        *) finish "$@" ;;
    esac
}

main "$@"
