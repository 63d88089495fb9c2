# Shared by the sbatch templates (sourced, not executed). sbatch copies a batch script into
# Slurm's spool directory, so the templates cannot find their siblings from $0: they locate
# the rocmoe checkout through ROCMOE_HOME, defaulting to the directory sbatch was run from.

ROCMOE_HOME="${ROCMOE_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}"
ROCMOE_LAUNCH="$ROCMOE_HOME/slurm/rocmoe-launch"
if [ ! -x "$ROCMOE_LAUNCH" ]; then
    echo "rocmoe: $ROCMOE_LAUNCH not found; submit from the rocmoe checkout or set ROCMOE_HOME" >&2
    exit 2
fi

# The program to run, from the batch script's arguments (`sbatch tmpl.sbatch python3 x.py -a`,
# which keeps arguments with spaces intact) or from ROCMOE_PROGRAM / ROCMOE_ARGS (split on
# white space), else the template's default ($1 of this function, may be empty).
rocmoe_program() {
    local default="$1"
    shift
    if [ "$#" -gt 0 ]; then
        PROGRAM=("$@")
    elif [ -n "${ROCMOE_PROGRAM:-}" ]; then
        # shellcheck disable=SC2206  # word splitting is the documented contract here
        PROGRAM=(${ROCMOE_PROGRAM} ${ROCMOE_ARGS:-})
    elif [ -n "$default" ]; then
        # shellcheck disable=SC2206
        PROGRAM=($default ${ROCMOE_ARGS:-})
    else
        echo "rocmoe: no program: sbatch $0 python3 train.py [args], or set ROCMOE_PROGRAM" >&2
        exit 2
    fi
}

# Site modules, only where Lmod/Environment Modules exist; ROCMOE_MODULES="" loads none.
rocmoe_modules() {
    local mods="$1"
    if [ -n "$mods" ] && command -v module >/dev/null 2>&1; then
        # shellcheck disable=SC2086
        module load $mods
    fi
}

rocmoe_banner() {
    echo "rocmoe job ${SLURM_JOB_ID:-?}: ${SLURM_NNODES:-1} node(s) [${SLURM_JOB_NODELIST:-$(hostname -s)}]," \
         "${SLURM_NTASKS:-?} tasks; program: ${PROGRAM[*]}"
}
