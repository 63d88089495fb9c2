"""The pieces of a training loop the examples share, below the models and above the runtime.

- :mod:`.group`: the run's ranks and bounded host collectives (one process needs no MPI);
- :mod:`.data_parallel`: gradient averaging of replicated parameters, rank-local ones scaled;
- :mod:`.checkpoint`: per-rank shards, atomic writes, the manifest last, all-or-nothing loads;
- :mod:`.preemption`: SIGUSR1/SIGTERM recorded, a stop voted by all ranks, the requeue code;
- :mod:`.run_log`: JSON lines on stdout, tqdm and text on stderr, step-time parts.
"""
