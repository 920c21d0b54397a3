#!/usr/bin/env bash
# local-slurm.sh — a real 4-node Slurm 22.05 cluster on this one host, for tests.
#
# Usage: scripts/local-slurm.sh start [--with-accounting] | stop | status | restart [--with-accounting]
#
#   start    install the Debian packages when missing, write /etc/slurm/slurm.conf, start munged,
#            slurmctld and four slurmd (c1,c2 in partition cpu (default); g1,g2 in partition gpu
#            with fake Gres=gpu:4), then wait until all four nodes are idle (when every daemon
#            was already running: until they are up, busy or not). Idempotent.
#   --with-accounting  also run MariaDB + slurmdbd so that `sacct` works (~+20 s on a fresh host).
#   stop     stop every daemon this script started, end leftover job steps, drop the /etc/hosts
#            block. Safe when nothing runs.
#   status   print daemon pids and `sinfo`; exit 0 only when all four nodes are up.
#   restart  stop, then start.
#
# Environment:
#   CK_SLURM_ROOT      all state, spool, logs, pid files, the munge key and socket
#                      (default /var/tmp/cyclone-slurm; created from nothing when empty)
#   CK_SLURM_CONF_DIR  where slurm.conf and gres.conf are written (default /etc/slurm). Anything
#                      else needs SLURM_CONF=$CK_SLURM_CONF_DIR/slurm.conf for sinfo/sbatch/...
#   CK_SLURM_PORT_OFFSET  added to every port (default 0): a second cluster beside the first one
#   CK_SLURM_TIMEOUT   seconds to wait for each daemon to answer and the nodes to become idle (default 120)
#   CK_SLURM_NO_UNSHARE=1  do not give each slurmd its own UTS namespace (task hostnames are then
#                      this host's name; used automatically where `unshare --uts` is refused)
#
# Must run as root (it writes /etc/slurm and /etc/hosts and starts root daemons). The cluster owns
# its munge daemon and key (under CK_SLURM_ROOT; the socket too, but for the /etc/slurm cluster,
# see MUNGE_SOCK), so nothing from an earlier run is read or needed. Facts behind each setting: shared/LOCAL-SLURM.md.
#
# Every failure says what failed: `die` for the expected ones, an ERR trap (command, line, exit
# code and a hint) for the rest. Nothing exits silently.
set -Eeuo pipefail

ROOT=${CK_SLURM_ROOT:-/var/tmp/cyclone-slurm}
TIMEOUT=${CK_SLURM_TIMEOUT:-120}
CONF_DIR=${CK_SLURM_CONF_DIR:-/etc/slurm}
CONF=$CONF_DIR/slurm.conf
export SLURM_CONF=$CONF # this script's own sinfo/scontrol/sacctmgr talk to this cluster
PORT_OFFSET=${CK_SLURM_PORT_OFFSET:-0}
CLUSTER=cyclone-local
NODES=(c1 c2 g1 g2)
HOSTS_BEGIN="# BEGIN cyclone-slurm $CONF_DIR (scripts/local-slurm.sh)"
HOSTS_END="# END cyclone-slurm $CONF_DIR"
MUNGE_DIR=$ROOT/munge
# The cluster in /etc/slurm serves munge's default socket: sacctmgr's connection to slurmdbd
# ignores AuthInfo=socket= (Slurm 22.05) and only finds the default one. Other clusters (a second
# one beside it, without accounting) keep theirs private.
if [[ $CONF_DIR == /etc/slurm ]]; then MUNGE_SOCK=/run/munge/munge.socket.2; else MUNGE_SOCK=$MUNGE_DIR/munge.socket; fi
BASE_PKGS=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge tini)
ACCT_PKGS=(slurmdbd mariadb-server)

die() { echo "local-slurm: $*" >&2; exit 1; }
log() { echo "local-slurm: $*"; }

# on_err RC LINE COMMAND: the ERR trap. Names what failed instead of exiting silently.
on_err() {
  trap - ERR
  echo "local-slurm: error: line $2: \`$3\` exited with status $1 HINT: the daemons' logs are in $ROOT/log; rerun with \`bash -x $0 ${ARGS[*]:-}\` to trace" >&2
  exit "$1"
}
ARGS=("$@")
trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR

[[ $PORT_OFFSET =~ ^[0-9]+$ ]] || die "CK_SLURM_PORT_OFFSET=$PORT_OFFSET is not a whole number HINT: unset it or use e.g. 100"
CTLD_PORT=$((16817 + PORT_OFFSET))
DBD_PORT=$((16819 + PORT_OFFSET))
node_port() {  # c1 -> 17001 ... g2 -> 17004
  local i
  for i in "${!NODES[@]}"; do
    [[ ${NODES[$i]} == "$1" ]] && { echo $((17001 + PORT_OFFSET + i)); return; }
  done
  die "unknown node $1"
}

# any_alive PID...: one of them still runs (a zombie does not count: PID 1 here reaps slowly).
any_alive() {
  local p stat
  for p in "$@"; do
    stat=$(cat "/proc/$p/stat" 2>/dev/null) || continue
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]] && return 0
  done
  return 1
}

# pid_alive PIDFILE NAME: the pid in PIDFILE runs a process whose comm starts with NAME.
pid_alive() {
  local pid comm
  [[ -s $1 ]] || return 1
  pid=$(head -n1 "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [[ $comm == "$2"* ]] && any_alive "$pid"
}

pid_of() { head -n1 "$1" 2>/dev/null || true; }

# stop_pid PIDFILE NAME [WAIT_S]: TERM, wait up to WAIT_S (default 10) seconds, then KILL.
stop_pid() {
  local pid i
  pid_alive "$1" "$2" || { rm -f "$1"; return 0; }
  pid=$(pid_of "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq $((${3:-10} * 10))); do
    any_alive "$pid" || break
    sleep 0.1
  done
  if any_alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$1"
}

require_root() {
  [[ $(id -u) == 0 ]] || die "must run as root (writes /etc/slurm, /etc/hosts and starts root daemons); try: sudo $0 ${*:-start}"
}

# ---------------------------------------------------------------------------------------------
# packages
ensure_packages() {
  local missing=() cmd
  declare -A bin_of=([slurmctld]=/usr/sbin/slurmctld [slurmd]=/usr/sbin/slurmd
    [slurm-client]=/usr/bin/sinfo
    [munge]=/usr/sbin/munged [tini]=/usr/bin/tini [slurmdbd]=/usr/sbin/slurmdbd
    [mariadb-server]=/usr/sbin/mariadbd)
  for cmd in "$@"; do
    if [[ $cmd == slurm-wlm-basic-plugins ]]; then
      dpkg-query -W -f='${Status}' "$cmd" 2>/dev/null | grep -q 'install ok installed' || missing+=("$cmd")
    else
      [[ -x ${bin_of[$cmd]} ]] || missing+=("$cmd")
    fi
  done
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || die "missing packages (${missing[*]}) and apt-get is not available to install them"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$ROOT/log/apt.log" 2>&1; then
    apt-get update -q >>"$ROOT/log/apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$ROOT/log/apt.log" 2>&1 ||
      { tail -n 20 "$ROOT/log/apt.log" >&2; die "apt-get install ${missing[*]} failed (log: $ROOT/log/apt.log)"; }
  fi
}

# ---------------------------------------------------------------------------------------------
# configuration (pure text; written only when it changed)
render_slurm_conf() {
  local acct=$1 n
  cat <<EOF
# Written by scripts/local-slurm.sh — a 4-node test cluster on one host. Do not edit by hand.
ClusterName=$CLUSTER
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: a requeued job may not start again for this long (Slurm default 120 s, minimum 5); 10 s leaves
# room for a step credential on a busy host while keeping each requeue of the Slurm tier short.
AuthInfo=cred_expire=10,socket=$MUNGE_SOCK
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000,sched_interval=5,bf_interval=5
MailProg=/bin/true
ReturnToService=2
# KillWait: SIGTERM to a cancelled step's tasks, SIGKILL this long after (Slurm default 30 s): time for
# 4 ranks on 2 shared cores to agree on a stop step and write their checkpoint even when the machine is
# 5x slower and busy (issue 27: tests/slurm/test_faults.py's cancel test needs the cancelled end record)
KillWait=60
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.txt
EOF
  if [[ $acct == 1 ]]; then
    cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageTRES=gres/gpu
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
EOF
  else
    echo "AccountingStorageType=accounting_storage/none"
  fi
  for n in "${NODES[@]}"; do
    case $n in
      g*) echo "NodeName=$n NodeAddr=127.0.0.1 Port=$(node_port "$n") CPUs=4 RealMemory=4000 Gres=gpu:4 State=UNKNOWN" ;;
      *) echo "NodeName=$n NodeAddr=127.0.0.1 Port=$(node_port "$n") CPUs=4 RealMemory=4000 State=UNKNOWN" ;;
    esac
  done
  echo "PartitionName=cpu Nodes=c1,c2 Default=YES MaxTime=1-00:00:00 State=UP"
  echo "PartitionName=gpu Nodes=g1,g2 Default=NO MaxTime=1-00:00:00 State=UP"
  # every node: a job with spare nodes (in-job restarts, tests/slurm/test_restart_in_job.py) needs 3 of them
  echo "PartitionName=wide Nodes=c1,c2,g1,g2 Default=NO MaxTime=1-00:00:00 State=UP"
}

render_gres_conf() {
  echo "# Written by scripts/local-slurm.sh: fake GPUs (character devices like /dev/null)."
  echo "NodeName=g1,g2 Name=gpu File=$ROOT/dev/nvidia[0-3]"
}

render_slurmdbd_conf() {
  cat <<EOF
# Written by scripts/local-slurm.sh
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
AuthInfo=socket=$MUNGE_SOCK
SlurmUser=root
PidFile=$ROOT/run/slurmdbd.pid
LogFile=$ROOT/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
}

# write_if_changed FILE MODE < text ; returns 0 when the file changed.
write_if_changed() {
  local tmp
  tmp=$(mktemp "$1.XXXXXX")
  cat >"$tmp"
  chmod "$2" "$tmp"
  if [[ -f $1 ]] && cmp -s "$tmp" "$1"; then
    rm -f "$tmp"
    return 1
  fi
  mv -f "$tmp" "$1"
  return 0
}

# /etc/hosts may be a bind mount: rewrite it in place, never rename over it.
hosts_remove_block() {
  [[ -w /etc/hosts ]] || return 0
  grep -qF "$HOSTS_BEGIN" /etc/hosts || return 0
  local kept
  kept=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0==b{skip=1;next} $0==e{skip=0;next} !skip' /etc/hosts)
  printf '%s\n' "$kept" >/etc/hosts
}

hosts_add_block() {
  hosts_remove_block
  if ! { echo "$HOSTS_BEGIN"; echo "127.0.0.1 ${NODES[*]}"; echo "$HOSTS_END"; } >>/etc/hosts 2>/dev/null; then
    log "warning: /etc/hosts is not writable; node names ${NODES[*]} will not resolve (jobs still run)"
  fi
}

make_fake_gpus() {
  local i f
  install -d "$ROOT/dev"
  for i in 0 1 2 3; do
    f=$ROOT/dev/nvidia$i
    [[ -c $f ]] && continue
    rm -f "$f"
    mknod "$f" c 1 3 2>/dev/null || { log "mknod refused; using a plain file for $f"; touch "$f"; }
  done
}

# ---------------------------------------------------------------------------------------------
# daemons
munge_ok() { munge -S "$MUNGE_SOCK" -n 2>/dev/null | unmunge -S "$MUNGE_SOCK" >/dev/null 2>&1; }

# start_munge: this cluster's own munged (root, --force), key and socket under $MUNGE_DIR; the
# key is made here when missing, so neither /etc/munge nor a running system munged is needed.
start_munge() {
  munge_ok && return 0
  install -d -m 0700 "$MUNGE_DIR"
  if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    log "creating $MUNGE_DIR/munge.key"
    dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$MUNGE_DIR/munge.key"
  fi
  stop_pid "$ROOT/run/munged.pid" munged 2
  install -d -m 0755 "$(dirname "$MUNGE_SOCK")"
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  detach "$ROOT/log/munged.out" /usr/sbin/munged -F --force --socket="$MUNGE_SOCK" \
    --key-file="$MUNGE_DIR/munge.key" --pid-file="$MUNGE_DIR/munged.pid" \
    --log-file="$ROOT/log/munged.log" --seed-file="$MUNGE_DIR/munged.seed" >"$ROOT/run/munged.pid"
  local deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    munge_ok && return 0
    any_alive "$(pid_of "$ROOT/run/munged.pid")" || break # comm may still be setsid/nohup
    sleep 0.1
  done
  tail -n 5 "$ROOT/log/munged.out" "$ROOT/log/munged.log" >&2 2>/dev/null || true
  die "munged did not answer on $MUNGE_SOCK (log: $ROOT/log/munged.log)"
}

# detach LOGFILE CMD...: run CMD in its own session, immune to the caller's exit; echoes its pid.
detach() {
  local out=$1
  shift
  setsid nohup "$@" </dev/null >>"$out" 2>&1 &
  echo $!
}

start_mariadb() {
  local datadir=$ROOT/mysql sock=/run/mysqld/mysqld.sock i
  install -d -o mysql -g mysql /run/mysqld
  if [[ ! -d $datadir/mysql ]]; then
    install -d -o mysql -g mysql "$datadir"
    mariadb-install-db --user=mysql --datadir="$datadir" --auth-root-authentication-method=socket \
      >>"$ROOT/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (log: $ROOT/log/mariadb-install.log)"
  fi
  if ! pid_alive /run/mysqld/mysqld.pid mariadbd; then
    touch "$ROOT/run/mariadb.ours" # stop_all stops only a MariaDB this root started
    detach "$ROOT/log/mariadbd.log" /usr/sbin/mariadbd --user=mysql --datadir="$datadir" \
      --skip-networking --socket="$sock" --pid-file=/run/mysqld/mysqld.pid >/dev/null
  fi
  local deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    mariadb --socket="$sock" -e 'SELECT 1' >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  tail -n 20 "$ROOT/log/mariadbd.log" >&2
  die "MariaDB did not answer within ${TIMEOUT} s (CK_SLURM_TIMEOUT)"
}

start_slurmdbd() {
  local deadline=$((SECONDS + TIMEOUT))
  pid_alive "$ROOT/run/slurmdbd.pid" slurmdbd || detach "$ROOT/log/slurmdbd.out" /usr/sbin/slurmdbd -D >/dev/null
  while ((SECONDS < deadline)); do
    timeout 10 sacctmgr -n -P show cluster >/dev/null 2>&1 && break
    sleep 0.2
  done
  timeout 10 sacctmgr -n -P show cluster >/dev/null 2>&1 ||
    { tail -n 20 "$ROOT/log/slurmdbd.log" >&2; die "slurmdbd did not answer within ${TIMEOUT} s (CK_SLURM_TIMEOUT)"; }
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || true
  fi
}

start_slurmctld() {
  pid_alive "$ROOT/run/slurmctld.pid" slurmctld && return 0
  local pid deadline=$((SECONDS + TIMEOUT))
  pid=$(detach "$ROOT/log/slurmctld.out" /usr/sbin/slurmctld -D -f "$CONF")
  echo "$pid" >"$ROOT/run/slurmctld.pid" # slurmctld rewrites it with the same pid
  while ((SECONDS < deadline)); do
    scontrol ping 2>/dev/null | grep -q 'is UP' && return 0
    [[ -d /proc/$pid ]] || break
    sleep 0.1
  done
  tail -n 20 "$ROOT/log/slurmctld.log" "$ROOT/log/slurmctld.out" >&2 2>/dev/null || true
  die "slurmctld did not come up"
}

# CK_SLURM_NO_UNSHARE=1 forces the fallback (to test it).
can_unshare_uts() { [[ ${CK_SLURM_NO_UNSHARE:-0} != 1 ]] && unshare --uts true 2>/dev/null; }

start_slurmd() {
  local node=$1 uts=$2
  pid_alive "$ROOT/run/slurmd-$node.pid" slurmd && return 0
  install -d "$ROOT/spool/$node"
  # tini -s: a child subreaper reaps slurmstepd orphans promptly (PID 1 here is slow at it).
  # setsid execs in place (a background job is no group leader), so $! becomes the tini pid.
  if [[ $uts == 1 ]]; then
    # shellcheck disable=SC2016 # $1 and $2 expand in the inner sh
    detach "$ROOT/log/slurmd-$node.out" unshare --uts sh -c \
      'hostname "$1" && exec tini -s -- /usr/sbin/slurmd -D -N "$1" -f "$2"' sh "$node" "$CONF" >"$ROOT/run/tini-$node.pid"
  else
    detach "$ROOT/log/slurmd-$node.out" tini -s -- /usr/sbin/slurmd -D -N "$node" -f "$CONF" >"$ROOT/run/tini-$node.pid"
  fi
}

# fail_stale_jobs NODE...: these slurmd were just (re)started, so no job step survives on them; jobs
# the saved state still shows there would hold the nodes until slurmctld times them out (minutes).
# Cancelling them ends them now (cycling the nodes DOWN would requeue them instead).
fail_stale_jobs() {
  (($#)) || return 0
  local list ids
  list=$(IFS=,; echo "$*")
  ids=$({ squeue -h -t R,CG,S -w "$list" -o %i 2>/dev/null || true; } | sort -u | tr '\n' ' ')
  [[ -n ${ids// /} ]] || return 0
  log "cancelling jobs left running from before the restart: $ids"
  # shellcheck disable=SC2086
  scancel $ids >/dev/null 2>&1 || true
}

node_states() { { sinfo -h -N -o '%N %t' 2>/dev/null || true; } | sort -u; }

# ready_nodes: how many nodes answer and take jobs: idle, or busy with jobs already (mix, alloc,
# comp) when start is called on a running cluster. A "*" suffix means not responding.
ready_nodes() { awk '$2 ~ /^(idle|mix|alloc|comp)$/' <<<"$1" | wc -l; }

# wait_idle STRICT: until every node is idle (STRICT=1, after starting daemons) or at least up
# (STRICT=0: the cluster was already running and may be busy with jobs).
wait_idle() {
  local strict=$1 deadline=$((SECONDS + TIMEOUT)) states n resumed=0
  while :; do
    states=$(node_states)
    if ((strict)); then
      (($(awk '$2 == "idle"' <<<"$states" | wc -l) == ${#NODES[@]})) && return 0
    else
      (($(ready_nodes "$states") == ${#NODES[@]})) && return 0
    fi
    # A node left drained/down by an earlier run: return it to service once.
    if ((resumed == 0)) && grep -qE ' (drain|drng|down)' <<<"$states"; then
      while read -r n; do
        scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
      done < <(awk '$2 ~ /^(drain|drng|down)/ {print $1}' <<<"$states")
      resumed=1
    fi
    if ((SECONDS >= deadline)); then
      echo "local-slurm: nodes not idle after ${TIMEOUT}s:" >&2
      echo "$states" >&2
      for n in slurmctld.log slurmctld.out "${NODES[@]/#/slurmd-}"; do
        [[ $n == slurmd-* ]] && n=$n.log
        [[ -f $ROOT/log/$n ]] && { echo "--- $ROOT/log/$n (tail)" >&2; tail -n 8 "$ROOT/log/$n" >&2; }
      done
      die "timeout waiting for ${#NODES[@]} idle nodes (CK_SLURM_TIMEOUT=$TIMEOUT)"
    fi
    sleep 0.2
  done
}

# descendants PID...: every process below the PIDs (slurmd, its slurmstepd, their tasks), by pid, from one
# read of /proc for all of them. slurmstepd calls setsid(), so sessions do not track jobs; the tini subreaper's
# tree does. Reads /proc directly (procps may be missing on a minimal host); "pid (comm) state ppid ...".
descendants() {
  (($#)) || return 0
  { cat /proc/[0-9]*/stat 2>/dev/null || true; } | awk -v roots="$*" '
    { rest = $0; sub(/^.*\) /, "", rest); split(rest, f, " "); kids[f[2]] = kids[f[2]] " " $1 }
    END { n = split(roots, q, " "); r = n
          for (i = 1; i <= n; i++) { m = split(kids[q[i]], more, " "); for (j = 1; j <= m; j++) q[++n] = more[j] }
          for (i = r + 1; i <= n; i++) print q[i] }'
}

# slurm_pids: slurmctld and, per node, the tini pid with everything below it (slurmd, slurmstepd,
# job tasks) -- only processes this script started.
slurm_pids() {
  local n tini tinis=()
  pid_alive "$ROOT/run/slurmctld.pid" slurmctld && pid_of "$ROOT/run/slurmctld.pid"
  for n in "${NODES[@]}"; do
    tini=$(pid_of "$ROOT/run/tini-$n.pid")
    if [[ $tini =~ ^[0-9]+$ && $(cat "/proc/$tini/comm" 2>/dev/null) == tini ]]; then
      echo "$tini"
      tinis+=("$tini")
    fi
    pid_alive "$ROOT/run/slurmd-$n.pid" slurmd && pid_of "$ROOT/run/slurmd-$n.pid"
  done
  descendants "${tinis[@]}"
  return 0
}

# terminate PID...: TERM all at once, give them 3 s together, then KILL the rest. slurmstepd
# ignores TERM, so it does not count when deciding whether the others are done.
terminate() {
  local i p waiting
  (($#)) || return 0
  kill -TERM "$@" 2>/dev/null || true
  for i in $(seq 30); do
    waiting=()
    for p in "$@"; do [[ $(cat "/proc/$p/comm" 2>/dev/null) == slurmstepd ]] || waiting+=("$p"); done
    any_alive "${waiting[@]}" || break
    sleep 0.1
  done
  any_alive "$@" && kill -KILL "$@" 2>/dev/null
  return 0
}

# ---------------------------------------------------------------------------------------------
cmd_start() {
  local acct=0 changed=0 uts=1 n t0=$SECONDS fresh strict=1
  for arg in "$@"; do
    case $arg in
      --with-accounting) acct=1 ;;
      *) die "unknown option: $arg (usage: $0 start [--with-accounting])" ;;
    esac
  done
  require_root start
  install -d "$ROOT"/{state,spool,run,log,dev} "$CONF_DIR"
  if ((acct)); then ensure_packages "${BASE_PKGS[@]}" "${ACCT_PKGS[@]}"; else ensure_packages "${BASE_PKGS[@]}"; fi
  stop_other_root

  render_slurm_conf "$acct" | write_if_changed "$CONF" 0644 && changed=1
  render_gres_conf | write_if_changed "$CONF_DIR/gres.conf" 0644 && changed=1
  if ((acct)); then render_slurmdbd_conf | write_if_changed "$CONF_DIR/slurmdbd.conf" 0600 && changed=1; fi
  if ((changed)) && { pid_alive "$ROOT/run/slurmctld.pid" slurmctld || any_slurmd_alive || pid_alive "$ROOT/run/slurmdbd.pid" slurmdbd; }; then
    log "configuration changed; restarting the daemons"
    stop_slurm_daemons
  fi
  echo "$acct" >"$ROOT/run/accounting"

  if pid_alive "$ROOT/run/slurmctld.pid" slurmctld && ! any_slurmd_down; then strict=0; fi
  hosts_add_block
  make_fake_gpus
  start_munge
  if ((acct)); then start_mariadb; start_slurmdbd; fi
  start_slurmctld
  can_unshare_uts || { uts=0; log "unshare --uts refused: task hostnames will be $(hostname), not the node names"; }
  fresh=()
  for n in "${NODES[@]}"; do
    pid_alive "$ROOT/run/slurmd-$n.pid" slurmd || fresh+=("$n")
    start_slurmd "$n" "$uts"
  done
  fail_stale_jobs "${fresh[@]}"
  wait_idle "$strict"
  log "cluster up in $((SECONDS - t0)) s: partitions cpu (c1,c2; default) and gpu (g1,g2; gpu:4); root $ROOT$( ((acct)) && echo '; accounting on')"
}

any_slurmd_down() {
  local n
  for n in "${NODES[@]}"; do pid_alive "$ROOT/run/slurmd-$n.pid" slurmd || return 0; done
  return 1
}

any_slurmd_alive() {
  local n
  for n in "${NODES[@]}"; do pid_alive "$ROOT/run/slurmd-$n.pid" slurmd && return 0; done
  return 1
}

stop_slurm_daemons() {
  local n
  # shellcheck disable=SC2046 # word splitting of the pid list is intended
  terminate $(slurm_pids | sort -un)
  stop_pid "$ROOT/run/slurmdbd.pid" slurmdbd # it reads its configuration only when it starts
  rm -f "$ROOT/run/slurmctld.pid"
  for n in "${NODES[@]}"; do rm -f "$ROOT/run/slurmd-$n.pid" "$ROOT/run/tini-$n.pid"; done
}

# conf_root: the state root of the cluster /etc/slurm/slurm.conf describes (maybe another CK_SLURM_ROOT).
conf_root() {
  [[ -f $CONF ]] || return 0
  sed -n 's|^StateSaveLocation=\(.*\)/state$|\1|p' "$CONF" | head -n1
}

# stop_other_root: a cluster started with another CK_SLURM_ROOT holds the ports; stop it first (also when that
# root was deleted while its daemons ran: stray_pids finds them by their command lines).
stop_other_root() {
  local other
  other=$(conf_root)
  if [[ -n $other && $other != "$ROOT" ]] && { [[ -d $other/run ]] || [[ -n $(ROOT=$other && stray_pids) ]]; }; then
    log "stopping the cluster running from $other"
    local ROOT=$other # bash scoping is dynamic: stop_all and what it calls see this ROOT
    stop_all
  fi
}

# stray_pids: this cluster's daemons that no pid file names any more (the pid files were deleted or the
# state root moved while they ran; start would then fail on their ports): slurmctld, slurmd, tini, munged whose
# command line names this cluster's slurm.conf or state root, with everything below them.
stray_pids() {
  local f pid comm args found=()
  for f in /proc/[0-9]*/cmdline; do
    pid=${f#/proc/} && pid=${pid%/cmdline}
    # A process may end between the glob and these reads: each read fails quietly (in a `||` list, so the
    # ERR trap, inherited by command substitutions under set -E, does not fire).
    read -r comm 2>/dev/null <"/proc/$pid/comm" || continue
    case $comm in slurmctld | slurmd | tini | munged) ;; *) continue ;; esac
    args=$(tr '\0' ' ' 2>/dev/null <"$f" || true)
    if [[ $args == *" $CONF "* || $args == *"=$ROOT/"* ]]; then
      echo "$pid"
      found+=("$pid")
    fi
  done
  descendants "${found[@]}"
  return 0
}

stop_all() {
  local pids
  pids="$(slurm_pids) $(stray_pids)"
  if pid_alive "$ROOT/run/slurmdbd.pid" slurmdbd; then pids+=" $(pid_of "$ROOT/run/slurmdbd.pid")"; fi
  if pid_alive "$ROOT/run/munged.pid" munged; then pids+=" $(pid_of "$ROOT/run/munged.pid")"; fi
  # shellcheck disable=SC2046,SC2086 # word splitting of the pid list is intended
  terminate $(printf '%s\n' $pids | sort -un)
  rm -f "$ROOT"/run/{slurmctld,slurmdbd}.pid "$ROOT"/run/slurmd-*.pid "$ROOT"/run/tini-*.pid "$ROOT/run/munged.pid" "$ROOT/run/accounting"
  if [[ -f $ROOT/run/mariadb.ours ]]; then stop_pid /run/mysqld/mysqld.pid mariadbd; fi
  rm -f "$ROOT/run/mariadb.ours"
}

cmd_stop() {
  require_root stop
  stop_other_root
  stop_all
  hosts_remove_block
  log "stopped"
}

cmd_status() {
  local rc=0 name f c
  for name in slurmctld "${NODES[@]}"; do
    if [[ $name == slurmctld ]]; then f=$ROOT/run/slurmctld.pid; c=slurmctld; else f=$ROOT/run/slurmd-$name.pid; c=slurmd; name="slurmd $name"; fi
    if pid_alive "$f" "$c"; then echo "$name: running (pid $(pid_of "$f"))"; else echo "$name: stopped"; rc=1; fi
  done
  if [[ $(cat "$ROOT/run/accounting" 2>/dev/null) == 1 ]]; then
    if pid_alive "$ROOT/run/slurmdbd.pid" slurmdbd; then echo "slurmdbd: running"; else echo "slurmdbd: stopped"; rc=1; fi
  fi
  if ((rc == 0)); then
    sinfo -N -o '%N %P %t %c %G' || rc=1
    (($(ready_nodes "$(node_states)") == ${#NODES[@]})) || { echo "not every node is up"; rc=1; }
  fi
  return $rc
}

main() {
  local cmd=${1:-}
  shift || true
  case $cmd in
    start) cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    restart) cmd_stop && cmd_start "$@" ;;
    *) echo "usage: $0 start [--with-accounting] | stop | status | restart [--with-accounting]" >&2; exit 2 ;;
  esac
}

main "$@"
