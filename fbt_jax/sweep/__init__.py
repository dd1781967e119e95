"""Sweeps (`fbt-sweep`): `spec.py` expands a spec into runs, `plan.py` shares their trunks,
`state.py` is the sweep directory and each job's status, `executors.py` runs the jobs (local,
SLURM, print), `report.py` gathers the results, `cli.py` is the command."""
