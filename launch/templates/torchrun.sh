# One torchrun agent per Slurm task; agents meet at a c10d rendezvous hosted on the first node
# (no ssh, no pdsh). The port is derived from the job id so jobs sharing a node do not clash.
# (No pipe into head: with pipefail, scontrol's SIGPIPE on a long node list would abort the job.)
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
rdzv_port={{RDZV_PORT}}
# The batch step runs on the first node, where the head agent will host the rendezvous store: a port
# that something else listens on would make every agent hang, so check it here (a derived port moves to
# the next free one; a fixed slurm.rdzv_port fails the job with its holder named).
if [[ ${SLURMD_NODENAME:-} == "$head_node" ]]; then
    rdzv_port=$("$PY" -m launch.rendezvous_port "$rdzv_port"{{RDZV_FIXED}})
fi
echo "fpa: job ${SLURM_JOB_ID} train: ${SLURM_NTASKS} agents x {{NPROC}} workers, rendezvous ${head_node}:${rdzv_port}," \
    "restart ${SLURM_RESTART_COUNT:-0}"
# --signal=USR1@N (without B:) makes Slurm send USR1 to every process of the job step. torchrun itself
# would die of it (it handles TERM/INT/HUP/QUIT only), so each task ignores USR1 and then execs torchrun
# (an ignored signal stays ignored across exec); the training workers install their own handler (save a
# checkpoint, `scontrol requeue`, exit) and receive the signal directly. train.checkpoint.resume=auto
# makes the requeued job continue from that checkpoint.
# --cpus-per-task again: srun 22.05+ does not take it from the allocation, and one CPU per task would
# squeeze torchrun and all its workers onto one core.
srun --kill-on-bad-exit=1 --ntasks-per-node={{TASKS_PER_NODE}} --cpus-per-task={{CPUS_PER_TASK}} \
    bash -c 'trap "" USR1; mkdir -p "$TRITON_CACHE_DIR"; exec "$@"' fpa-task \
    "$PY" -m torch.distributed.run \
    --nnodes="$SLURM_NTASKS" --nproc-per-node={{NPROC}} \
    --rdzv-backend=c10d --rdzv-endpoint="${head_node}:${rdzv_port}" --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-conf=join_timeout={{RDZV_TIMEOUT}} --max-restarts=0 \
    -m launch.cli train "${CONFIGS[@]}" "${OVERRIDES[@]}" train.checkpoint.resume=auto
