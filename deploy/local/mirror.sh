# shellcheck shell=bash
# The local cluster's pull-through mirrors: Debian's docker-registry in proxy mode
# behind Debian's nginx.  The rack mirror is the first mirror of the upper half of
# the nodes when there are at least four (TFIMAGE_MIRROR=0: none); the region
# mirror, a second instance of the same (cloud.sh), is the cloud nodes' own, as a
# cloud region's registry replica would be.  Sourced by cluster.sh, which calls
# start_mirror and start_region after the registry, and stops them before it.
#
#   n1 .. n(N/2)        ask $REGISTRY (nginx, shaped: the site's uplink)
#   n(N/2+1) .. nN      ask $MIRROR first, unshaped: a rack's own switch
#   c1 .. cB            ask $REGION first (cloud.sh)
#        |
#   $MIRROR, $REGION    nginx: TLS, the site robot's password, and one fetch per
#        |              blob: concurrent cold requests wait for the first
#        |              (proxy_cache_lock), then read its copy
#   *_UPSTREAM          docker-registry, proxy.remoteurl http://$AS_SITE (what the
#        |              site robot reads, proxy.sh): manifests and blobs
#   $AS_SITE            crosses the shaped link, as the registry's uplink
#
# Why nginx in front: distribution's proxy never merges concurrent cold fetches of
# one blob, and 2.8 fetches each cold blob twice even alone (DESIGN.md: facts for
# many nodes; measured here: 2 upstream GETs for one cold request).  Eight nodes
# of a rack asking at once would cost the uplink nine copies.  And 2.8's proxy
# sends upstream credentials only to a Bearer token service, never as Basic auth,
# hence the site robot's view on loopback.
#
# Every cache starts empty with each up, as a rack's would after a rebuild.

MIRROR_PORT=5444
MIRROR=$CTL_ADDR:$MIRROR_PORT
MIRROR_UPSTREAM=127.0.0.1:5446
MIRROR_ON=${TFIMAGE_MIRROR:-1}  # checked, and off below four nodes, by cluster.sh

# The nodes behind the mirror, as a Slurm hostlist: n[3-4] of four.
mirror_nodes() {
    local first=$((NODE_COUNT / 2 + 1))
    if [ "$first" = "$NODE_COUNT" ]; then echo "n$first"; else echo "n[$first-$NODE_COUNT]"; fi
}

# start_pull_through NAME ADDR UPSTREAM WHAT: docker-registry in proxy mode on UPSTREAM
# behind nginx on ADDR; state in $STATE/NAME, access log $LOGS/NAME.log.
start_pull_through() {
    local name=$1 addr=$2 upstream=$3 what=$4
    local d=$STATE/$name
    rm -rf "$d"
    mkdir -p "$d/registry" "$d/cache" "$d/tmp"
    chmod 0700 "$d"
    htpasswd -Bbn "$ROBOT" "$(cat "$STATE/pki/robot.password")" >"$d/htpasswd" 2>/dev/null
    cat >"$d/registry.yml" <<YML
version: 0.1
log: {level: info, formatter: text}
storage:
  filesystem: {rootdirectory: $d/registry}
http:
  addr: $upstream
proxy:
  remoteurl: http://$AS_SITE
YML
    setsid docker-registry serve "$d/registry.yml" >"$LOGS/$name-registry.log" 2>&1 </dev/null &
    echo $! >"$RUN/$name-registry.pid"
    cat >"$d/nginx.conf" <<NGINX
user root;
worker_processes 1;
daemon off;
pid $d/nginx.pid;
error_log $d/error.log warn;
events { worker_connections 512; }
http {
    log_format mirror '\$remote_addr "\$request" \$status \$body_bytes_sent \$upstream_cache_status';
    access_log $LOGS/$name.log mirror;
    client_body_temp_path $d/tmp/body;
    proxy_temp_path $d/tmp/proxy;
    fastcgi_temp_path $d/tmp/fastcgi;
    uwsgi_temp_path $d/tmp/uwsgi;
    scgi_temp_path $d/tmp/scgi;
    proxy_cache_path $d/cache levels=1:2 keys_zone=blobs:10m max_size=64g inactive=1d use_temp_path=off;
    server {
        listen $addr ssl;
        ssl_certificate $STATE/pki/server.crt;
        ssl_certificate_key $STATE/pki/server.key;
        auth_basic "tfimage-mirror";
        auth_basic_user_file $d/htpasswd;
        proxy_read_timeout 900;
        add_header Docker-Distribution-Api-Version registry/2.0 always;
        # A blob is named by its digest: one copy serves every project and node
        # that may read it (nginx has checked the password first).
        location ~ "^/v2/.+/blobs/sha256:[0-9a-f]{64}\$" {
            proxy_pass http://$upstream;
            proxy_cache blobs;
            proxy_cache_key \$uri;
            proxy_cache_valid 200 1d;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 1h;
            proxy_cache_lock_age 1h;
        }
        location /v2/ {
            proxy_pass http://$upstream;
            proxy_buffering off;
        }
    }
}
NGINX
    setsid nginx -c "$d/nginx.conf" -p "$d" >>"$LOGS/$name-nginx.log" 2>&1 </dev/null &
    echo $! >"$RUN/$name.pid"
    local up front
    for _ in $(seq 100); do
        up=$(curl -s -o /dev/null -w '%{http_code}' "http://$upstream/v2/" || true)
        front=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$STATE/pki/ca.crt" \
            "https://$addr/v2/" || true)
        if [ "$up" = 200 ] && [ "$front" = 401 ]; then
            log "$what $addr up"
            return 0
        fi
        sleep 0.1
    done
    tail -n 5 "$LOGS/$name-registry.log" "$d/error.log" >&2 || true
    die "the $what did not come up on $addr"
}

start_mirror() {
    [ "$MIRROR_ON" = 1 ] || return 0
    start_pull_through mirror "$MIRROR" "$MIRROR_UPSTREAM" "rack mirror"
}

stop_pull_through() { # NAME: what start_pull_through NAME started
    stop_pid "$RUN/$1.pid"
    stop_pid "$RUN/$1-registry.pid"
}

stop_mirror() { stop_pull_through mirror; }

# The role's lines for both (cluster.sh's write_role_vars): each group's tier, and
# the credential the nodes show it (the site robot's, as each htpasswd has it).
mirror_role_vars() {
    local groups=()
    [ "$MIRROR_ON" = 0 ] || [ "$NODE_COUNT" -lt 4 ] || groups+=("\"$(mirror_nodes)\": [\"$MIRROR\"]")
    [ "$BURST_COUNT" = 0 ] || groups+=("\"$(burst_hostlist)\": [\"$REGION\"]")
    [ "${#groups[@]}" -gt 0 ] || return 0
    printf 'tfimage_rack_mirrors: {%s}\n' "$(IFS=,; echo "${groups[*]}")"
}

mirror_credentials() {
    local addr
    for addr in $([ "$MIRROR_ON" = 0 ] || echo "$MIRROR") $([ "$BURST_COUNT" = 0 ] || echo "$REGION"); do
        printf '  "%s":\n    username: "%s"\n    password: "%s"\n' \
            "$addr" "$ROBOT" "$(cat "$STATE/pki/robot.password")"
    done
}
