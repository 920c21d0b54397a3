#!/usr/bin/env bash
# local-slurm.sh — a real 4-node Slurm 22.05 cluster on this one host, for tests.
#
# Usage: scripts/local-slurm.sh start [--with-accounting] | stop | status | restart [--with-accounting]
#
#   start    install the Debian packages when missing, write /etc/slurm/slurm.conf, start munged,
#            slurmctld and four slurmd (c1,c2 in partition cpu (default); g1,g2 in partition gpu
#            with fake Gres=gpu:4), then wait until all four nodes are idle. Idempotent.
#   --with-accounting  also run MariaDB + slurmdbd so that `sacct` works (~+20 s on a fresh host).
#   stop     stop every daemon this script started, end leftover job steps, drop the /etc/hosts
#            block. Safe when nothing runs.
#   status   print daemon pids and `sinfo`; exit 0 only when all four nodes answer.
#   restart  stop, then start.
#
# Environment:
#   CK_SLURM_ROOT      all state, spool, logs, pid files (default /var/tmp/cyclone-slurm)
#   CK_SLURM_TIMEOUT   seconds to wait for the nodes to become idle (default 60)
#
# Must run as root (it writes /etc/slurm and /etc/hosts and starts root daemons). Facts behind each
# setting: shared/LOCAL-SLURM.md.
set -euo pipefail

ROOT=${CK_SLURM_ROOT:-/var/tmp/cyclone-slurm}
TIMEOUT=${CK_SLURM_TIMEOUT:-60}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
CLUSTER=cyclone-local
NODES=(c1 c2 g1 g2)
HOSTS_BEGIN="# BEGIN cyclone-slurm (scripts/local-slurm.sh)"
HOSTS_END="# END cyclone-slurm"
CTLD_PORT=16817
DBD_PORT=16819
BASE_PKGS=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge tini)
ACCT_PKGS=(slurmdbd mariadb-server)

die() { echo "local-slurm: $*" >&2; exit 1; }
log() { echo "local-slurm: $*"; }

node_port() {  # c1 -> 17001 ... g2 -> 17004
  local i
  for i in "${!NODES[@]}"; do
    [[ ${NODES[$i]} == "$1" ]] && { echo $((17001 + i)); return; }
  done
  die "unknown node $1"
}

# pid_alive PIDFILE NAME: the pid in PIDFILE runs a process whose comm starts with NAME.
pid_alive() {
  local pid comm
  [[ -s $1 ]] || return 1
  pid=$(head -n1 "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [[ $comm == "$2"* ]]
}

pid_of() { head -n1 "$1" 2>/dev/null || true; }

# stop_pid PIDFILE NAME: TERM, wait up to 5 s, then KILL.
stop_pid() {
  local pid i
  pid_alive "$1" "$2" || { rm -f "$1"; return 0; }
  pid=$(pid_of "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 50); do
    [[ -d /proc/$pid ]] || break
    sleep 0.1
  done
  [[ -d /proc/$pid ]] && kill -KILL "$pid" 2>/dev/null || true
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
    [slurm-client]=/usr/bin/sinfo [slurm-wlm-basic-plugins]=/usr/lib/x86_64-linux-gnu/slurm-wlm/select_cons_tres.so
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
AuthInfo=cred_expire=30
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
KillWait=5
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
  { echo "$HOSTS_BEGIN"; echo "127.0.0.1 ${NODES[*]}"; echo "$HOSTS_END"; } >>/etc/hosts
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
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  munge_ok && return 0
  [[ -s /etc/munge/munge.key ]] || {
    log "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  }
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge 2>/dev/null || true
  runuser -u munge -- /usr/sbin/munged --force >>"$ROOT/log/munged.out" 2>&1 ||
    die "munged failed to start: $(tail -n 3 "$ROOT/log/munged.out" | tr '\n' ' ')"
  touch "$ROOT/run/munged.ours"
  local i
  for i in $(seq 50); do munge_ok && return 0; sleep 0.1; done
  die "munged started but munge -n | unmunge fails"
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
    detach "$ROOT/log/mariadbd.log" /usr/sbin/mariadbd --user=mysql --datadir="$datadir" \
      --skip-networking --socket="$sock" --pid-file=/run/mysqld/mysqld.pid >/dev/null
  fi
  for i in $(seq 300); do
    mariadb --socket="$sock" -e 'SELECT 1' >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  tail -n 20 "$ROOT/log/mariadbd.log" >&2
  die "MariaDB did not answer within 30 s"
}

start_slurmdbd() {
  local i
  pid_alive "$ROOT/run/slurmdbd.pid" slurmdbd || detach "$ROOT/log/slurmdbd.out" /usr/sbin/slurmdbd -D >/dev/null
  for i in $(seq 300); do
    sacctmgr -n -P show cluster >/dev/null 2>&1 && break
    sleep 0.1
  done
  sacctmgr -n -P show cluster >/dev/null 2>&1 || { tail -n 20 "$ROOT/log/slurmdbd.log" >&2; die "slurmdbd did not answer within 30 s"; }
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || true
  fi
}

start_slurmctld() {
  pid_alive "$ROOT/run/slurmctld.pid" slurmctld && return 0
  local pid i
  pid=$(detach "$ROOT/log/slurmctld.out" /usr/sbin/slurmctld -D -f "$CONF")
  echo "$pid" >"$ROOT/run/slurmctld.pid" # slurmctld rewrites it with the same pid
  for i in $(seq 100); do
    scontrol ping 2>/dev/null | grep -q 'is UP' && return 0
    [[ -d /proc/$pid ]] || break
    sleep 0.1
  done
  tail -n 20 "$ROOT/log/slurmctld.log" "$ROOT/log/slurmctld.out" >&2 2>/dev/null || true
  die "slurmctld did not come up"
}

can_unshare_uts() { unshare --uts true 2>/dev/null; }

start_slurmd() {
  local node=$1 uts=$2
  pid_alive "$ROOT/run/slurmd-$node.pid" slurmd && return 0
  install -d "$ROOT/spool/$node"
  # tini -s: a child subreaper reaps slurmstepd orphans promptly (PID 1 here is slow at it).
  # setsid execs in place (a background job is no group leader), so $! becomes the tini pid.
  if [[ $uts == 1 ]]; then
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
  ids=$(squeue -h -t R,CG,S -w "$list" -o %i 2>/dev/null | sort -u | tr '\n' ' ')
  [[ -n ${ids// /} ]] || return 0
  log "cancelling jobs left running from before the restart: $ids"
  # shellcheck disable=SC2086
  scancel $ids >/dev/null 2>&1 || true
}

node_states() { sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

wait_idle() {
  local deadline=$((SECONDS + TIMEOUT)) states idle n resumed=0
  while :; do
    states=$(node_states)
    idle=$(awk '$2=="idle"' <<<"$states" | wc -l)
    ((idle == ${#NODES[@]})) && return 0
    # A node left drained/down by an earlier run: return it to service once.
    if ((resumed == 0)) && grep -qE ' (drain|drng|down)' <<<"$states"; then
      for n in $(awk '$2 ~ /^(drain|drng|down)/ {print $1}' <<<"$states"); do
        scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
      done
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

# descendants PID: every process below PID (slurmd, its slurmstepd, their tasks), by pid.
# slurmstepd calls setsid(), so sessions do not track jobs; the tini subreaper's tree does.
descendants() {
  ps -e -o pid=,ppid= | awk -v root="$1" '
    { kids[$2] = kids[$2] " " $1 }
    END { n = split(kids[root], q, " "); for (i = 1; i <= n; i++) { print q[i]; m = split(kids[q[i]], more, " "); for (j = 1; j <= m; j++) q[++n] = more[j] } }'
}

any_alive() {
  local p
  for p in "$@"; do [[ -d /proc/$p ]] && return 0; done
  return 1
}

# slurm_pids: slurmctld and, per node, the tini pid with everything below it (slurmd, slurmstepd,
# job tasks) -- only processes this script started.
slurm_pids() {
  local n tini
  pid_alive "$ROOT/run/slurmctld.pid" slurmctld && pid_of "$ROOT/run/slurmctld.pid"
  for n in "${NODES[@]}"; do
    tini=$(pid_of "$ROOT/run/tini-$n.pid")
    if [[ $tini =~ ^[0-9]+$ && $(cat "/proc/$tini/comm" 2>/dev/null) == tini ]]; then
      echo "$tini"
      descendants "$tini"
    fi
    pid_alive "$ROOT/run/slurmd-$n.pid" slurmd && pid_of "$ROOT/run/slurmd-$n.pid"
  done
  return 0
}

# terminate PID...: TERM all at once, give them 3 s together, then KILL the rest.
terminate() {
  local i
  (($#)) || return 0
  kill -TERM "$@" 2>/dev/null || true
  for i in $(seq 30); do
    any_alive "$@" || return 0
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null || true
}

# ---------------------------------------------------------------------------------------------
cmd_start() {
  local acct=0 changed=0 uts=1 n t0=$SECONDS fresh
  for arg in "$@"; do
    case $arg in
      --with-accounting) acct=1 ;;
      *) die "unknown option: $arg (usage: $0 start [--with-accounting])" ;;
    esac
  done
  require_root start
  install -d "$ROOT"/{state,spool,run,log,dev} "$CONF_DIR"
  if ((acct)); then ensure_packages "${BASE_PKGS[@]}" "${ACCT_PKGS[@]}"; else ensure_packages "${BASE_PKGS[@]}"; fi

  render_slurm_conf "$acct" | write_if_changed "$CONF" 0644 && changed=1
  render_gres_conf | write_if_changed "$CONF_DIR/gres.conf" 0644 && changed=1
  if ((acct)); then render_slurmdbd_conf | write_if_changed "$CONF_DIR/slurmdbd.conf" 0600 && changed=1; fi
  if ((changed)) && { pid_alive "$ROOT/run/slurmctld.pid" slurmctld || any_slurmd_alive; }; then
    log "configuration changed; restarting the daemons"
    stop_slurm_daemons
  fi
  echo "$acct" >"$ROOT/run/accounting"

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
  wait_idle
  log "cluster up in $((SECONDS - t0)) s: partitions cpu (c1,c2; default) and gpu (g1,g2; gpu:4); root $ROOT$( ((acct)) && echo '; accounting on')"
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
  rm -f "$ROOT/run/slurmctld.pid"
  for n in "${NODES[@]}"; do rm -f "$ROOT/run/slurmd-$n.pid" "$ROOT/run/tini-$n.pid"; done
}

cmd_stop() {
  local pids
  require_root stop
  pids=$(slurm_pids)
  pid_alive "$ROOT/run/slurmdbd.pid" slurmdbd && pids+=" $(pid_of "$ROOT/run/slurmdbd.pid")"
  # only a munged this script started
  [[ -f $ROOT/run/munged.ours ]] && pid_alive /run/munge/munged.pid munged && pids+=" $(pid_of /run/munge/munged.pid)"
  # shellcheck disable=SC2046,SC2086 # word splitting of the pid list is intended
  terminate $(printf '%s\n' $pids | sort -un)
  rm -f "$ROOT"/run/{slurmctld,slurmdbd}.pid "$ROOT"/run/slurmd-*.pid "$ROOT"/run/tini-*.pid "$ROOT/run/munged.ours"
  stop_pid /run/mysqld/mysqld.pid mariadbd
  hosts_remove_block
  log "stopped"
}

cmd_status() {
  local n rc=0 name
  for name in slurmctld "${NODES[@]}"; do
    if [[ $name == slurmctld ]]; then f=$ROOT/run/slurmctld.pid; c=slurmctld; else f=$ROOT/run/slurmd-$name.pid; c=slurmd; name="slurmd $name"; fi
    if pid_alive "$f" "$c"; then echo "$name: running (pid $(pid_of "$f"))"; else echo "$name: stopped"; rc=1; fi
  done
  if [[ $(cat "$ROOT/run/accounting" 2>/dev/null) == 1 ]]; then
    pid_alive "$ROOT/run/slurmdbd.pid" slurmdbd && echo "slurmdbd: running" || { echo "slurmdbd: stopped"; rc=1; }
  fi
  if ((rc == 0)); then sinfo -N -o '%N %P %t %c %G' || rc=1; fi
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
