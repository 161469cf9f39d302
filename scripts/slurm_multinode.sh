#!/bin/bash
# Multi-node DDP fine-tuning on SLURM: one `accelerate launch` per node, each starting one process per GPU.
#   sbatch scripts/slurm_multinode.sh                                   # tiny model, the defaults below
#   sbatch --nodes=4 scripts/slurm_multinode.sh --model_name_or_path roberta-base --output_dir runs/rb-4n
# Arguments are recipe flags (recipes/cls.py). Submit from the repository root: the configs are relative paths.
# Expect in slurm-<jobid>.out, from node 0: "training ... on <nodes x GPUs> process(es), MULTI_GPU", then
# "eval accuracy ...". Edit the #SBATCH lines for your cluster (partition, account, time).
#SBATCH --job-name=cls-multinode
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node; it forks one training process per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16           # data loading and tokenization for the node's processes
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
if [[ -f .venv/bin/activate ]]; then
    source .venv/bin/activate
fi

# SLURM_GPUS_ON_NODE follows --gpus-per-node, also when it is changed on the sbatch command line.
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-4}
# The first node of the allocation hosts the rendezvous; a host name works as well as an address. `sed -n 1p`
# rather than `head -n1`: head exits early, scontrol can die of SIGPIPE, and pipefail then stops the script (141).
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
# A port derived from the job id, so two jobs sharing a node do not fight over one port.
MAIN_PORT=$((20000 + SLURM_JOB_ID % 10000))
NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
export MAIN_IP MAIN_PORT NUM_PROCESSES
# export NCCL_SOCKET_IFNAME=ib0      # uncomment, with your interface, if NCCL picks the wrong network
# export NCCL_DEBUG=WARN

if [[ $# -eq 0 ]]; then
    set -- --model_name_or_path artifacts/tiny-roberta --output_dir "runs/multinode-$SLURM_JOB_ID"
fi

# Fail here, in seconds, rather than on every node after the data is tokenized: bad flags, bad config.
python scripts/check_config.py accelerate_configs/multinode.yaml "$@"

echo "nodes: $SLURM_JOB_NODELIST; main: $MAIN_IP:$MAIN_PORT; processes: $NUM_PROCESSES ($GPUS_PER_NODE per node)"
# Single quotes: $SLURM_NODEID must be expanded by each node's own task (0, 1, ...), not here on node 0.
# The command-line flags override the YAML's num_machines, num_processes, machine_rank and main_process_ip/port.
# --cpus-per-task again for srun: Slurm 22.05 to 23.02 does not pass sbatch's value on to srun's tasks.
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" bash -c '
    exec accelerate launch --config_file accelerate_configs/multinode.yaml \
        --num_machines "$SLURM_NNODES" \
        --num_processes "$NUM_PROCESSES" \
        --machine_rank "$SLURM_NODEID" \
        --main_process_ip "$MAIN_IP" \
        --main_process_port "$MAIN_PORT" \
        recipes/cls.py "$@"
' bash "$@"
