"""What a run is made of around the model: config.py (config files, overrides, checks), cli.py (flags, the runtime
set-up, the error guard of every face), checkpoint.py (orbax checkpoints, export to HF), metrics_log.py,
save_errors.py, guard.py (the workdir lock, a lease; stop on SIGTERM, the resume check), record.py (what a run
records), paths.py (every file under a workdir, local or gs://).

Imports: models/, rewards/.
"""
