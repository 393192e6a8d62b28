"""One module per params.yaml section: its dataclass (SECTION names the key), allowed values and
checks. quantpipe.params reads them; quantpipe.schemas.all checks a whole file."""
