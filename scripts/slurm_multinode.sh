#!/bin/bash
# Multi-node DDP fine-tuning on SLURM: one `accelerate launch` per node, each starting one process per GPU.
#   sbatch scripts/slurm_multinode.sh                                   # tiny model, the defaults below
#   sbatch --nodes=4 scripts/slurm_multinode.sh --model_name_or_path roberta-base --output_dir runs/rb-4n
#   ACCELERATE_CONFIG=accelerate_configs/zero2_multinode.yaml sbatch scripts/slurm_multinode.sh ...   # ZeRO-2
# Arguments are recipe flags (recipes/cls.py). Submit from the repository root: the configs are relative paths.
# Expect in slurm-<jobid>.out, from node 0: "training ... on <nodes x GPUs> process(es), MULTI_GPU", then
# "eval accuracy ...". Edit the #SBATCH lines for your cluster (partition, account, time).
# Restartable: the recipe runs with --resume_from_checkpoint auto (unless you pass --resume_from_checkpoint), so the
# same job starts fresh the first time and continues from its newest checkpoint after a requeue. SLURM_SIGNAL_LEAD
# seconds before the time limit SLURM sends USR1 to this script, which turns it into SIGTERM for the launch: every
# rank stops at the same step, checkpoints it and writes <output_dir>/checkpoints/PREEMPTED; the script then requeues
# the job. Give the recipe --checkpointing_steps as well, so a crash loses little (docs/checkpoints.md, "Long runs").
#SBATCH --job-name=cls-multinode
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node; it forks one training process per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16           # data loading and tokenization for the node's processes
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append           # a requeued job appends to the same log
#SBATCH --requeue                    # `scontrol requeue` below may put the job back in the queue
#SBATCH --signal=B:USR1@180          # USR1 to this script (B:) 180 s before the time limit; = SLURM_SIGNAL_LEAD
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
# Any multi-machine accelerate config: the launch line below sets its machines, processes, rank and address.
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/multinode.yaml}
export MAIN_IP MAIN_PORT NUM_PROCESSES ACCELERATE_CONFIG
# export NCCL_SOCKET_IFNAME=ib0      # uncomment, with your interface, if NCCL picks the wrong network
# export NCCL_DEBUG=WARN
# After the SIGTERM, torch's elastic agent gives the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (torch 2.13.0's
# default: 30) before its SIGKILL. The workers need up to --logging_steps optimizer steps to agree on the stop, then
# the checkpoint write: a roberta-large checkpoint with its optimizer state takes longer than 30 s on many file
# systems. Leave some of the signal's lead for the requeue.
SLURM_SIGNAL_LEAD=180
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((SLURM_SIGNAL_LEAD - 30))}
# With `accelerate launch --max_restarts N --rdzv_backend c10d` (restarts inside the job, added below by hand) each
# attempt needs a store of its own: torch shares the agent's store by default and a restarted group cannot connect.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

if [[ $# -eq 0 ]]; then
    set -- --model_name_or_path artifacts/tiny-roberta --output_dir "runs/multinode-$SLURM_JOB_ID"
fi
# The output folder (where the preemption marker is written) and the restartable resume, from the recipe flags.
OUTPUT_DIR=runs/cls  # the recipe's default
RESUME_GIVEN=0
previous=
for arg in "$@"; do
    case "$previous" in --output_dir) OUTPUT_DIR=$arg ;; esac
    case "$arg" in --output_dir=*) OUTPUT_DIR=${arg#*=} ;; --resume_from_checkpoint*) RESUME_GIVEN=1 ;; esac
    previous=$arg
done
if [[ $RESUME_GIVEN -eq 0 ]]; then
    set -- "$@" --resume_from_checkpoint auto
fi
MARKER="$OUTPUT_DIR/checkpoints/PREEMPTED"
rm -f "$MARKER"  # a marker left by an earlier run is not this run's

# Fail here, in seconds, rather than on every node after the data is tokenized: bad flags, bad config, a process
# count the config cannot split over the machines. The same counts as the launch below.
python scripts/check_config.py "$ACCELERATE_CONFIG" --num_processes "$NUM_PROCESSES" --num_machines "$SLURM_NNODES" "$@"

echo "nodes: $SLURM_JOB_NODELIST; main: $MAIN_IP:$MAIN_PORT; processes: $NUM_PROCESSES ($GPUS_PER_NODE per node)"
# Single quotes: $SLURM_NODEID must be expanded by each node's own task (0, 1, ...), not here on node 0.
# The command-line flags override the YAML's num_machines, num_processes, machine_rank and main_process_ip/port.
# --cpus-per-task again for srun: Slurm 22.05 to 23.02 does not pass sbatch's value on to srun's tasks.
# In the background, so that the USR1 trap runs while the launch goes on (bash runs traps between commands only).
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" bash -c '
    exec accelerate launch --config_file "$ACCELERATE_CONFIG" \
        --num_machines "$SLURM_NNODES" \
        --num_processes "$NUM_PROCESSES" \
        --machine_rank "$SLURM_NODEID" \
        --main_process_ip "$MAIN_IP" \
        --main_process_port "$MAIN_PORT" \
        recipes/cls.py "$@"
' bash "$@" &
LAUNCH=$!
# srun forwards the signals it receives to its tasks (srun(1)), here each node's launcher: its elastic agent sends
# SIGTERM on to the workers (it does not forward USR1: torch 2.13.0 handles SIGTERM, SIGINT, SIGHUP and SIGQUIT).
trap 'echo "signal: asking every rank to checkpoint and stop"; kill -TERM "$LAUNCH" 2>/dev/null || true' USR1 TERM
STATUS=0
wait "$LAUNCH" || STATUS=$?
while kill -0 "$LAUNCH" 2>/dev/null; do  # a trap ended the wait early: the launch is still saving
    STATUS=0
    wait "$LAUNCH" || STATUS=$?
done
if [[ -f "$MARKER" ]]; then
    echo "preempted at $(cat "$MARKER"): requeueing job $SLURM_JOB_ID, which resumes from there"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$STATUS"
