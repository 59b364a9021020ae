echo "fpa: job ${SLURM_JOB_ID} prepare{{STEP_LABEL}} on $(hostname)"
"$PY" -m launch.cli prepare{{STEP_ARGS}} "${CONFIGS[@]}" "${OVERRIDES[@]}"
