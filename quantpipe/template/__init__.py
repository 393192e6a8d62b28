"""This repository's dvc.yaml (pipeline.yaml) and params.yaml, which `quantpipe init` writes (quantpipe.cli)."""
