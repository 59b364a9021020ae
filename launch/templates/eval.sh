echo "fpa: job ${SLURM_JOB_ID} eval on $(hostname)"
"$PY" -m pipeline.cli eval "${CONFIGS[@]}" "${OVERRIDES[@]}"
