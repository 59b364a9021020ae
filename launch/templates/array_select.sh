# Element i of the job array takes line i (0-based) of the run list: its overrides, tab-separated.
RUN_LIST={{RUN_LIST}}
mapfile -t RUN_LINES < "$RUN_LIST"
line=${RUN_LINES[$SLURM_ARRAY_TASK_ID]:-}
if [[ -z "$line" ]]; then
    echo "fpa: error: no line $SLURM_ARRAY_TASK_ID in $RUN_LIST" >&2
    exit 1
fi
IFS=$'\t' read -r -a OVERRIDES <<< "$line"
echo "fpa: sweep {{SWEEP}} element ${SLURM_ARRAY_TASK_ID}: ${OVERRIDES[*]}"
