#!/usr/bin/env bash
# A single-node SLURM cluster on this machine (Debian 12, slurm-wlm 22.05), for the Snakemake
# tests and for trying the cluster workflow on a workstation.
#
#   bash scripts/slurm-local.sh start    # install slurm-wlm if needed, write the config, start daemons
#   bash scripts/slurm-local.sh stop     # stop the daemons
#   bash scripts/slurm-local.sh status   # sinfo
#
# Minimal on purpose: no munge (AuthType=auth/none, CredType=cred/none work in 22.05), no
# accounting (so sacct is off: Snakemake is told to use squeue), one node = this machine with its
# CPUs and memory as `slurmd -C` reports them. Needs root (it writes /etc/slurm/slurm.conf,
# which must stay at that path: the job-step plugin ignores SLURM_CONF).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
STATE=/var/spool/slurm-local
LOGS=/var/log/slurm-local

need_root() { [ "$(id -u)" -eq 0 ] || { echo "slurm-local: needs root" >&2; exit 1; }; }

install() {
    command -v slurmctld >/dev/null && command -v sbatch >/dev/null && return
    echo "slurm-local: installing slurm-wlm" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm >/dev/null; }
}

write_conf() {
    local node host
    host=$(hostname -s)
    # slurmd -C: "NodeName=<host> CPUs=... RealMemory=..." for this machine.
    node=$(slurmd -C | head -1)
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$LOGS"
    cat > "$CONF" <<CONF
# Written by scripts/slurm-local.sh: a one-node test cluster.
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
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
MinJobAge=300
$node State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
    need_root
    install
    if scontrol ping 2>/dev/null | grep -q "is UP"; then
        echo "slurm-local: already running"; sinfo; return
    fi
    write_conf
    local node
    node=$(slurmd -C | head -1 | sed 's/^NodeName=\([^ ]*\).*/\1/')
    slurmctld -c            # -c: clear any previous state (jobs of an earlier test run)
    slurmd -N "$node"
    for _ in $(seq 1 30); do
        if sinfo -h -o "%T" 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
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
    for pid in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
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
