"""The stage scripts, one per DVC stage: `python -m stages.<name>` here, `python -m
quantpipe.stages.<name>` where quantpipe is installed (a repository made by `quantpipe init`)."""
