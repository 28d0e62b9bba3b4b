# shellcheck shell=bash
# The local cluster's accounting: slurmdbd on Debian's MariaDB, both started without
# systemd as the other daemons are.  Sourced by cluster.sh, which calls
# start_accounting before slurmctld (the cluster and its accounts exist before
# slurmctld loads them), and stop_accounting after slurmctld is down.
#
#   slurmctld --AccountingStorage--> slurmdbd $CTL_ADDR:$DBD_PORT (the flavor's own
#                                     Slurm: a slurmdbd is never older than its ctld)
#                                        |
#                                     mariadbd 127.0.0.1:$DB_PORT, socket $RUN/mariadb/mariadb.sock
#                                       datadir $STATE/mariadb (made once, kept);
#                                       the database slurm_acct_db (fresh each up, as
#                                       slurmctld's state is: job ids start again at 1)
#
# Accounts: team-a holds TEST_USER, team-b holds TEST_USER2 (root stays in root).
# Fair share is priority/multifactor's (slurm_conf_accounting), usage decayed once
# a minute (PriorityCalcPeriod's least): a test waits up to that for sshare to move.
#
# Ports of their own (not 3306 and 6819): a site's MariaDB or slurmdbd on the same
# machine is left alone.
# TFIMAGE_ACCOUNTING=0 leaves all of it out (no AccountingStorageType, priority/basic).

ACCOUNTING_ON=${TFIMAGE_ACCOUNTING:-1}
DB_PORT=3307
DBD_PORT=6839
DB_NAME=slurm_acct_db
DB_USER=slurm
ACCOUNTS=(team-a team-b)

# The slurm.conf lines for accounting and fair share (nothing when it is off).
slurm_conf_accounting() {
    if [ "$ACCOUNTING_ON" = 1 ]; then
        cat <<CONF
# Accounting in slurmdbd (deploy/local/accounting.sh), fair share between the teams
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_ADDR
AccountingStoragePort=$DBD_PORT
AccountingStoreFlags=job_comment
PriorityType=priority/multifactor
PriorityDecayHalfLife=7-0
PriorityCalcPeriod=1
PriorityWeightFairshare=10000
PriorityWeightPartition=1000
PriorityWeightAge=0
CONF
    else
        echo "PriorityType=priority/basic"
    fi
}

db_sql() { # SQL: run as MariaDB's root, through its socket
    mariadb --no-defaults --socket="$RUN/mariadb/mariadb.sock" -u root -e "$1"
}

start_mariadb() {
    local d=$STATE/mariadb
    if [ ! -f "$d/.complete" ]; then
        rm -rf "$d"
        mkdir -p "$d"
        chown mysql:mysql "$d"
        mariadb-install-db --no-defaults --user=mysql --datadir="$d" \
            --auth-root-authentication-method=socket --skip-test-db >"$LOGS/mariadb-install.log" 2>&1 \
            || { tail -20 "$LOGS/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
        touch "$d/.complete"
    fi
    # Its own directories for what it writes: it runs as mysql.
    install -d -o mysql -g mysql -m 0755 "$RUN/mariadb"
    install -d -o mysql -g mysql -m 0750 "$LOGS/mariadb"
    rm -f "$RUN/mariadb/mariadb.sock"
    # The daemon itself in the foreground under setsid: $! is its pid.
    setsid mariadbd --no-defaults --user=mysql --datadir="$d" --socket="$RUN/mariadb/mariadb.sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$RUN/mariadb/mariadbd.pid" \
        --skip-name-resolve --innodb-buffer-pool-size=128M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 \
        --innodb-flush-log-at-trx-commit=2 --log-error="$LOGS/mariadb/mariadb.log" </dev/null >/dev/null 2>&1 &
    echo $! >"$RUN/mariadb.pid"
    for _ in $(seq 200); do
        [ -S "$RUN/mariadb/mariadb.sock" ] && db_sql "SELECT 1" >/dev/null 2>&1 && return 0
        alive "$RUN/mariadb.pid" || break
        sleep 0.1
    done
    tail -n 5 "$LOGS/mariadb/mariadb.log" >&2 || true
    die "MariaDB did not come up on 127.0.0.1:$DB_PORT"
}

write_slurmdbd_conf() {
    [ -s "$STATE/pki/db.password" ] || (umask 077; openssl rand -hex 16 >"$STATE/pki/db.password")
    # slurmdbd refuses a slurmdbd.conf that others can read: it holds the password.
    (umask 077; cat >"$ETC/slurmdbd.conf" <<CONF
# Written by deploy/local/accounting.sh
AuthType=auth/munge
DbdHost=$(hostname -s)
DbdAddr=$CTL_ADDR
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=$RUN/slurmdbd.own.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=$DB_USER
StoragePass=$(cat "$STATE/pki/db.password")
StorageLoc=$DB_NAME
CONF
    )
}

# slurmdbd of the flavor's Slurm, in the foreground under setsid ($! is its pid);
# waits until it answers.  Also what `cluster.sh slurmdbd start` runs.
start_slurmdbd() {
    alive "$RUN/slurmdbd.pid" && return 0
    local pre=()
    [ -z "$ROOT" ] || pre=(chroot "$ROOT")
    SLURM_CONF=$ETC/slurm.conf setsid "${pre[@]}" slurmdbd -D </dev/null >>"$LOGS/slurmdbd.out" 2>&1 &
    echo $! >"$RUN/slurmdbd.pid"
    for _ in $(seq 300); do
        SLURM_CONF=$ETC/slurm.conf in_root sacctmgr -n -P show cluster format=cluster >/dev/null 2>&1 \
            && return 0
        alive "$RUN/slurmdbd.pid" || break
        sleep 0.1
    done
    tail -n 5 "$LOGS/slurmdbd.out" "$LOGS/slurmdbd.log" >&2 || true
    die "slurmdbd did not come up on $CTL_ADDR:$DBD_PORT"
}

start_accounting() {
    [ "$ACCOUNTING_ON" = 1 ] || return 0
    local t0=$SECONDS pw
    start_mariadb
    write_slurmdbd_conf
    pw=$(cat "$STATE/pki/db.password")
    # The database made here, not by slurmdbd: Slurm 24.11.5's slurmdbd that creates
    # it itself fails its next query against Debian 13's MariaDB 11.8 ("5027 Number
    # of columns in result (=1) set exceeds maximum allowed number of columns (=0)",
    # then fatal in _check_mysql_concat_is_sane); with it there, it starts.
    db_sql "DROP DATABASE IF EXISTS $DB_NAME;
        CREATE DATABASE $DB_NAME;
        CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$pw';
        ALTER USER '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$pw';
        GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'127.0.0.1';" \
        || die "MariaDB: could not make $DB_NAME's user"
    : >"$LOGS/slurmdbd.log"
    start_slurmdbd
    SLURM_CONF=$ETC/slurm.conf in_root sacctmgr -i -Q add cluster tfimage >/dev/null \
        || die "sacctmgr could not add the cluster"
    add_accounts
    log "accounting: slurmdbd and MariaDB up in $((SECONDS - t0)) s"
}

# The teams' accounts and their users, each user's default account its team's.
add_accounts() {
    [ "$ACCOUNTING_ON" = 1 ] || return 0
    local mgr=(in_root sacctmgr -i -Q)
    export SLURM_CONF=$ETC/slurm.conf
    "${mgr[@]}" add account "${ACCOUNTS[@]}" Cluster=tfimage Fairshare=1 >/dev/null \
        || die "sacctmgr could not add the accounts"
    "${mgr[@]}" add user "$TEST_USER" Account=team-a Cluster=tfimage >/dev/null \
        || die "sacctmgr could not add $TEST_USER"
    "${mgr[@]}" add user "$TEST_USER2" Account=team-b Cluster=tfimage >/dev/null \
        || die "sacctmgr could not add $TEST_USER2"
}

stop_slurmdbd() {
    stop_pid "$RUN/slurmdbd.pid"
}

stop_accounting() {
    stop_slurmdbd
    stop_pid "$RUN/mariadb.pid"
    rm -f "$RUN/mariadb/mariadb.sock"
}
