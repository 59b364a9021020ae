# Site setup from slurm.env_setup (module loads, venv activation), if any; before `set -u`, which
# many module scripts do not survive.
{{ENV_SETUP}}
set -euo pipefail

# The project's code, whether or not it is installed in the interpreter below.
export PYTHONPATH={{REPO_ROOT}}${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS={{OMP_THREADS}}
# Runtime and NCCL settings, all in one place (slurm.env).
{{ENV_EXPORTS}}
# Node-local Triton cache: a shared filesystem cache is slow and races between nodes.
export TRITON_CACHE_DIR={{LOCAL_TMP}}/"${USER:-$(id -un)}"/triton-"${SLURM_JOB_ID}"

PY={{PYTHON}}
CONFIGS=({{CONFIGS}})
