"""Environments real Slurm job steps had on the local test cluster (fixtures for rank bootstrap tests)."""

from __future__ import annotations

SLURM_TASK3 = {
    "SLURMD_NODENAME": "c2", "SLURM_CLUSTER_NAME": "cyclone-local", "SLURM_CPUS_ON_NODE": "2",
    "SLURM_DISTRIBUTION": "block", "SLURM_GTIDS": "2,3", "SLURM_JOBID": "22", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "22", "SLURM_JOB_NAME": "wrap", "SLURM_JOB_NODELIST": "c[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "cpu", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "1",
    "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "c[1-2]", "SLURM_NPROCS": "4",
    "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "c[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_TOPOLOGY_ADDR": "c2",
}


SLURM_BATCH = {
    "SLURMD_NODENAME": "c1", "SLURM_JOBID": "22", "SLURM_JOB_ID": "22", "SLURM_JOB_NODELIST": "c[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "c[1-2]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2(x2)",
}
