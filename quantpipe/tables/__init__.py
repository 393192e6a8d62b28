"""The measured tables of README.md and docs/, one module per study (quantpipe.docs renders the
documents' generated blocks with them)."""
