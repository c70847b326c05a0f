#!/usr/bin/env bash
# A small SLURM cluster on this machine (Debian 12, slurm-wlm 22.05), for the Snakemake tests and
# for trying the cluster workflow on a workstation.
#
#   bash scripts/slurm-local.sh start    # install slurm-wlm if needed, write the config, start daemons
#   bash scripts/slurm-local.sh stop     # stop the daemons
#   bash scripts/slurm-local.sh status   # sinfo
#
# Minimal on purpose: no munge (AuthType=auth/none, CredType=cred/none work in 22.05), no
# accounting (so sacct is off: Snakemake is told to use squeue). The default partition `local` is
# one node = this machine with its CPUs and memory as `slurmd -C` reports them. The partition `two`
# adds a second node, `<host>-2`: a second slurmd on this same host (its own port, spool and log),
# so a job can ask for two nodes and its `srun` starts one task on each, as on two machines. Both
# nodes count this machine's CPUs, so a two-node job shares them with whatever runs on `local`.
# Needs root (it writes /etc/slurm/slurm.conf, which must stay at that path: the job-step plugin
# ignores SLURM_CONF).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
STATE=/var/spool/slurm-local
LOGS=/var/log/slurm-local

node_name() { slurmd -C | head -1 | sed 's/^NodeName=\([^ ]*\).*/\1/'; }

need_root() { [ "$(id -u)" -eq 0 ] || { echo "slurm-local: needs root" >&2; exit 1; }; }

install() {
    command -v slurmctld >/dev/null && command -v sbatch >/dev/null && return
    echo "slurm-local: installing slurm-wlm" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm >/dev/null; }
}

# The config this version of the script writes, on stdout.
render_conf() {
    local node name host
    host=$(hostname -s)
    # slurmd -C: "NodeName=<host> CPUs=... RealMemory=..." for this machine (the line's rest: UpTime).
    node=$(slurmd -C | head -1)
    name=$(node_name)
    cat <<CONF
# Written by scripts/slurm-local.sh: a test cluster on this one machine (partition two: two nodes).
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
# A finished job stays in scontrol show job for an hour (default 5 minutes): tests read the
# state of a pipeline's first job after its last one ends.
MinJobAge=3600
$node Port=6818 State=UNKNOWN
${node/NodeName=$name /NodeName=$name-2 NodeHostname=$host NodeAddr=127.0.0.1 } Port=6819 State=UNKNOWN
PartitionName=local Nodes=$name Default=YES MaxTime=INFINITE State=UP
PartitionName=two Nodes=$name,$name-2 MaxTime=INFINITE State=UP
CONF
}

write_conf() {
    local name
    name=$(node_name)
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d-$name" "$STATE/d-$name-2" "$LOGS"
    render_conf > "$CONF"
}

start() {
    need_root
    install
    if scontrol ping 2>/dev/null | grep -q "is UP"; then
        # A cluster this script did not write is left alone; one an older version wrote is restarted.
        if ! grep -q "^# Written by scripts/slurm-local.sh" "$CONF" || [ "$(render_conf)" = "$(cat "$CONF")" ]; then
            echo "slurm-local: already running"; sinfo; return
        fi
        echo "slurm-local: restarting a cluster that an older version of this script configured"
        stop >/dev/null
    fi
    write_conf
    local node
    node=$(node_name)
    slurmctld -c            # -c: clear any previous state (jobs of an earlier test run)
    slurmd -N "$node"
    slurmd -N "$node-2"
    for _ in $(seq 1 30); do
        if [ "$(sinfo -h -N -o "%N %T" 2>/dev/null | grep -cE " (idle|mixed|allocated)$")" -ge 2 ]; then
            sinfo; return
        fi
        sleep 1
    done
    echo "slurm-local: the node did not come up; logs in $LOGS" >&2
    tail -20 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 || true
    exit 1
}

stop() {
    need_root
    for pid in "$STATE"/slurmd*.pid "$STATE/slurmctld.pid"; do
        [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
    done
    pkill -x slurmd 2>/dev/null || true
    pkill -x slurmctld 2>/dev/null || true
    echo "slurm-local: stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) sinfo ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
