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

# Run the launcher ("$@": mpiexec ... or srun ...) so that the job survives its time limit and
# preemption: the launcher runs in the background, so this shell stays alive to hear the
# signals Slurm sends it (--signal=B:USR1@<seconds> reaches the batch shell only), and
# forwards USR1 and TERM to the launcher, which passes them on to every rank (mpiexec and srun
# both do). The examples then finish their step, write a checkpoint and exit 75
# (ROCMOE_REQUEUE_EXIT); this function answers that with `scontrol requeue`, and the
# requeued job resumes from the checkpoint (`--resume auto`). Any other status is returned.
rocmoe_run_requeueable() {
    "$@" &
    local child=$! rc=0
    trap 'kill -USR1 "$child" 2>/dev/null || true' USR1
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM
    while :; do
        # a trapped signal interrupts `wait` (status > 128) while the launcher still runs
        wait "$child" && rc=0 || rc=$?
        kill -0 "$child" 2>/dev/null || break
    done
    trap - USR1 TERM
    if [ "$rc" = "${ROCMOE_REQUEUE_EXIT:-75}" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
        echo "rocmoe: the program stopped for a requeue (exit $rc); scontrol requeue $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || return "$rc"
        return 0
    fi
    return "$rc"
}
