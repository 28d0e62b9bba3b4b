# shellcheck shell=bash
# The local cluster's registry front: Debian's nginx with a robot per project, as
# Harbor has them.  Sourced by cluster.sh, which calls start_proxy after the
# registry and stop_proxy before it.
#
#   $REGISTRY (TLS)  nginx: /v2/team-a/ for TEAM_ROBOT only, the rest for $ROBOT
#        |
#   $UPSTREAM        docker-registry, plain HTTP on loopback, no auth of its own
#
#   $AS_SITE         nginx, plain HTTP on loopback: the site robot's view, for the
#                    rack mirror (mirror.sh)
#
# Debian's docker-registry has one htpasswd for every repository, so the
# per-project refusal is nginx's (deploy/local/project_proxy.py writes its config,
# the distribution project's auth-proxy recipe with a location per project).

UPSTREAM=127.0.0.1:5442
# What the site's robot reads, without asking for its password: the rack mirror's
# upstream (mirror.sh), on loopback only.
AS_SITE=127.0.0.1:5445
TEAM=team-a
TEAM_ROBOT='robot$team-a+ci'

start_proxy() {
    local d=$STATE/proxy
    mkdir -p "$d"
    chmod 0700 "$d"
    [ -s "$STATE/pki/team-a.password" ] || (umask 077; openssl rand -hex 16 >"$STATE/pki/team-a.password")
    htpasswd -Bbn "$ROBOT" "$(cat "$STATE/pki/robot.password")" >"$d/site.htpasswd" 2>/dev/null
    htpasswd -Bbn "$TEAM_ROBOT" "$(cat "$STATE/pki/team-a.password")" >"$d/$TEAM.htpasswd" 2>/dev/null
    python3 "$REPO/deploy/local/project_proxy.py" --as-site="$AS_SITE" "$REGISTRY" "$UPSTREAM" \
        "$STATE/pki/server.crt" "$STATE/pki/server.key" "$d" "$d/site.htpasswd" \
        "$TEAM=$d/$TEAM.htpasswd" >"$d/nginx.conf"
    setsid nginx -c "$d/nginx.conf" -p "$d" >"$LOGS/proxy.log" 2>&1 </dev/null &
    echo $! >"$RUN/proxy.pid"
    for _ in $(seq 100); do
        code=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$STATE/pki/ca.crt" \
            "https://$REGISTRY/v2/" || true)
        [ "$code" = 401 ] && return 0
        sleep 0.1
    done
    tail -n 5 "$LOGS/proxy.log" "$d/error.log" >&2 || true
    die "the registry's proxy did not come up on $REGISTRY"
}

stop_proxy() {
    stop_pid "$RUN/proxy.pid"
}
