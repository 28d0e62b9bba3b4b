# Sourced by every script in deploy/local (and spank/build-other.sh):
#     . err-trap.sh NAME
# so that no script stops without a word.  A pipeline that died of SIGPIPE under
# pipefail once ended the demo right after "images: building ..." with no message at
# all; with this, any command that fails under `set -e` prints one line naming the
# script, the step (the chain of functions), the line, the command and its status:
#     images: error: step build_tf, line 99: `glibc=$(chroot "$r" ldd --version | head -1)` exited 141 (SIGPIPE)
# shellcheck shell=bash
TFIMAGE_ERR_NAME=${1:?usage: . err-trap.sh NAME}
# Functions, command substitutions and subshells inherit the trap.
set -E

_tfimage_on_err() { # STATUS LINE COMMAND PIPESTATUS
    local rc=$1 line=$2 cmd=$3 statuses=$4 i chain="" why=""
    # In a subshell (a command substitution, a pipeline's element) stay quiet: the
    # command around it fails next, in the script itself, and is reported there.
    [ "$BASH_SUBSHELL" = 0 ] || return 0
    for ((i = ${#FUNCNAME[@]} - 1; i >= 1; i--)); do
        case ${FUNCNAME[i]} in main | source) continue ;; esac
        chain+="${chain:+ > }${FUNCNAME[i]}"
    done
    [ "$rc" -le 128 ] || why=" (SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128))))"
    [ "${statuses// /}" = "$rc" ] || why+="; pipeline statuses: $statuses"
    printf '%s: error: %sline %s: `%s` exited %s%s\n' "$TFIMAGE_ERR_NAME" \
        "${chain:+step $chain, }" "$line" "$cmd" "$rc" "$why" >&2
}
trap '_tfimage_on_err $? $LINENO "$BASH_COMMAND" "${PIPESTATUS[*]}"' ERR
