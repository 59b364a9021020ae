echo "fpa: job ${SLURM_JOB_ID} prepare on $(hostname)"
"$PY" -m pipeline.cli prepare "${CONFIGS[@]}" "${OVERRIDES[@]}"
