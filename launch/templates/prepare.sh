echo "fpa: job ${SLURM_JOB_ID} prepare on $(hostname)"
"$PY" -m launch.cli prepare "${CONFIGS[@]}" "${OVERRIDES[@]}"
