echo "fpa: job ${SLURM_JOB_ID} eval on $(hostname)"
"$PY" -m launch.cli eval "${CONFIGS[@]}" "${OVERRIDES[@]}"
